"""Runtime: what every data-parallel script otherwise writes by hand, each piece optional.

It is not a trainer: the loop stays yours. It joins the job, tells this rank its device, wraps
the model in :class:`lockstep.DistributedDataParallel` when there are several workers, builds
sharded loaders, prints and shows a progress bar on rank 0 only, reduces metrics and gathers
evaluation results, and leaves the job cleanly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping, Sized
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from typing_extensions import Self

from lockstep.distributed import DEFAULT_TIMEOUT, init_distributed, shutdown_distributed
from lockstep.doctor.profile_env import profiling_requested
from lockstep.env import ProcessInfo
from lockstep.helper.collectives import Metric, all_reduce_metrics, gather_for_eval
from lockstep.helper.loader import ShardedLoader

__all__ = ["Runtime"]


def _is_ddp(model: torch.nn.Module) -> bool:
    # Duck typing covers lockstep's DDP and torch's alike without importing the DDP machinery.
    return isinstance(getattr(model, "module", None), torch.nn.Module) and hasattr(model, "no_sync")


class Runtime:
    """This process's place in a data-parallel job, and the chores that come with it.

    Creating it joins the job (:func:`lockstep.init_distributed`: torchrun's, SLURM's or no
    environment, the last being a world of one); leaving its ``with`` block (or
    :meth:`shutdown`) leaves it, if this object was the one that joined.

    Args:
        backend: ``"nccl"``/``"gloo"``; by default NCCL on GPUs, gloo on CPUs.
        timeout: how long a collective may wait for a peer.
        device: this rank's device; by default its GPU where there are GPUs, else the CPU.
            ``"cuda"`` without an index means GPU ``LOCAL_RANK``; on a torch build without
            CUDA it raises a RuntimeError that says so.

    Example::

        with lockstep.Runtime() as rt:
            model = rt.wrap(Net())
            opt = torch.optim.AdamW(model.parameters())
            loader = rt.dataloader(dataset, batch_size=32, shuffle=True)
            for epoch in rt.progress(range(3)):
                loader.set_epoch(epoch)
                for x, y in loader:
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad(); loss.backward(); opt.step()
                rt.print("epoch", epoch, "loss", rt.all_reduce(loss))
    """

    def __init__(
        self,
        backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        device: torch.device | str | None = None,
    ) -> None:
        self._owns_group = not dist.is_initialized()
        self.info: ProcessInfo = init_distributed(backend, timeout, device)

    # -- who am I ------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes files."""
        return self.info.is_main

    @property
    def device(self) -> torch.device:
        return self.info.device

    # -- the model -----------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Move ``model`` to this rank's device; with several workers, wrap it in DDP.

        Args:
            model: the model, on any device.
            **ddp_kwargs: passed to :class:`lockstep.DistributedDataParallel`.

        Returns:
            The DDP-wrapped model, or with a world of one the model itself.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            what = getattr(model, "__qualname__", None) or type(model).__name__
            raise TypeError(
                f"Runtime.wrap expects a torch.nn.Module, got {type(model).__name__} {what!r}. "
                "Pass the model object (e.g. rt.wrap(Net())), not a function or class that "
                "builds it."
            )
        model = model.to(self.device)
        if self.world_size == 1 and not profiling_requested():
            return model  # (under `lockstep doctor` even a world of one is wrapped: it is timed)
        from lockstep.ddp.wrapper import DistributedDataParallel

        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device])
        return DistributedDataParallel(model, **ddp_kwargs)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bare model inside a DDP wrapper (for saving or evaluating), else ``model``."""
        inner = model.module if _is_ddp(model) else model
        assert isinstance(inner, torch.nn.Module)
        return inner

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronisation inside the block (gradient accumulation).

        ``model.no_sync()`` under DDP; a context that does nothing for a bare model.
        """
        if _is_ddp(model):
            return model.no_sync()  # type: ignore[operator]  # DDP's no_sync
        return contextlib.nullcontext()

    # -- data ----------------------------------------------------------------------------------

    def dataloader(
        self,
        dataset: Sized,
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        seed: int = 0,
        drop_last: bool = False,
        to_device: bool = True,
        **loader_kwargs: Any,
    ) -> ShardedLoader:
        """A loader over this rank's shard of ``dataset`` (see :class:`ShardedLoader`).

        Args:
            dataset: the dataset.
            batch_size: samples per batch on this rank (the job's batch is ``world_size`` times).
            shuffle: reshuffle each epoch; call ``loader.set_epoch(epoch)`` before each.
            seed: the shuffle's seed, the same on every rank.
            drop_last: drop the dataset's uneven tail and the last partial batch.
            to_device: move batches to this rank's device.
            **loader_kwargs: for ``torch.utils.data.DataLoader`` (``num_workers``...).
        """
        device = self.device if to_device else None
        return ShardedLoader(
            dataset, batch_size, self.rank, self.world_size, device, shuffle, seed, drop_last,
            **loader_kwargs,
        )

    # -- people-facing output, rank 0 only -----------------------------------------------------

    def print(self, *values: Any, sep: str = " ", end: str = "\n", file: Any = None,
              flush: bool = False) -> None:
        """``print`` on rank 0 only, without breaking a progress bar that is showing.

        Takes ``print``'s keywords (``file=``, ``flush=`` were a ``TypeError`` until 2026-11-29).
        """
        if self.is_main:
            tqdm.write(sep.join(str(v) for v in values), file=file, end=end)
            if flush:
                (file if file is not None else sys.stdout).flush()

    def progress(self, iterable: Iterable | None = None, **tqdm_kwargs: Any) -> tqdm:
        """A tqdm progress bar shown on rank 0; on other ranks a silent one with the same API."""
        tqdm_kwargs.setdefault("dynamic_ncols", True)
        return tqdm(iterable, disable=not self.is_main, **tqdm_kwargs)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(
        self, value: Metric | Mapping[str, Metric], op: str = "mean"
    ) -> Metric | dict[str, Metric]:
        """Reduce a metric, or a dict of them, over all ranks (``mean``/``sum``/``max``/``min``).

        Every rank must call it. Numbers come back as floats, tensors keep shape and device.
        """
        self._check_joined("all_reduce")
        return all_reduce_metrics(value, op, device=self._collective_device())

    def gather_for_eval(self, tensor: torch.Tensor, total: int | Sized) -> torch.Tensor:
        """Every rank's per-sample results in sampler order, the sampler's padding dropped.

        Args:
            tensor: this rank's results for its whole shard, one row per sample.
            total: the evaluation dataset, or its length.
        """
        self._check_joined("gather_for_eval")
        return gather_for_eval(tensor, total, device=self._collective_device())

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self._check_joined("barrier")
        if self.device.type == "cuda" and self.info.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _check_joined(self, method: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"Runtime.{method}() after the job was left (the Runtime's with block ended, or "
                "shutdown() or destroy_process_group() was called): call it inside the with "
                "block, before shutdown()"
            )

    def _collective_device(self) -> torch.device:
        return self.device if self.info.backend == "nccl" else torch.device("cpu")

    # -- leaving -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the job (destroy the process group this object created); safe to call twice."""
        if self._owns_group:
            shutdown_distributed()
            self._owns_group = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
