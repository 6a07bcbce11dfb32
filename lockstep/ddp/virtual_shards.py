"""The same run at any world size: data parallelism over virtual shards, bitwise on 1..V ranks.

The global batch is ``V`` virtual shards of fixed membership (see
:class:`lockstep.virtual_sampler.VirtualShardSampler`). Each of ``N`` ranks runs its ``V/N``
consecutive shards one after another; every shard's forward sees only its samples (BatchNorm
statistics are per shard), draws its random numbers from a generator seeded by
``(seed, step, shard)``, and its loss is its own mean. Shard gradients are added in one fixed
binary tree over the ``V`` shards (:mod:`lockstep.ddp.shard_tree`), so parameters, optimizer
states and the reported loss are bitwise the same at every world size that divides ``V``.

Buffers (BatchNorm running statistics): every shard starts from the step's buffers, and the new
floating-point buffers are the tree mean of the shards' results; integer buffers (such as
``num_batches_tracked``) take the value every shard computes alike, and one that comes out of a
rank's shards differently (it depends on the data) is refused.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.ddp.shard_buckets import ShardBuckets
from lockstep.ddp.shard_tree import TreeSum, combine_subtrees
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.distributed import global_rank
from lockstep.env import OMP_FROM_LAUNCHER_ENV, threads_per_share
from lockstep.virtual_world import check_virtual_shards, resolve_virtual_shards

__all__ = ["VirtualShardDDP", "shard_seed", "split_shards"]

_MASK = (1 << 63) - 1


def shard_seed(seed: int, step: int, shard: int) -> int:
    """The RNG seed of ``shard`` at ``step``: a fixed mix of the three, the same on every rank."""
    value = seed & _MASK
    for part in (step, shard):
        value = (value * 6364136223846793005 + part + 1442695040888963407) & _MASK
    return value


def split_shards(batch: Any, shards: int) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors) into ``shards`` equal parts on dim 0.

    A list or tuple of plain values as long as the batch (strings, ids: what a ``DataLoader``
    collates from per-sample non-tensor fields) is split the same way; any other non-tensor
    value (a constant) goes to every shard whole. Namedtuples keep their type.
    """
    return _split_batch(batch, shards, _batch_size(batch))


def _batch_size(batch: Any) -> int | None:
    """dim 0 of the batch's first tensor (None: it holds no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        size = _batch_size(item)
        if size is not None:
            return size
    return None


def _split_batch(batch: Any, shards: int, size: int | None) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % shards != 0:
            raise ValueError(
                f"a batch of {batch.shape[0]} samples does not split into {shards} equal "
                f"virtual shards: use VirtualShardSampler, whose batches always do"
            )
        return list(batch.chunk(shards))
    if isinstance(batch, (tuple, list)):
        if size is not None and len(batch) == size and size % shards == 0 and not any(
                isinstance(item, (torch.Tensor, tuple, list, dict)) for item in batch):
            step = size // shards  # per-sample plain values, collated into a list
            return [type(batch)(batch[i * step:(i + 1) * step]) for i in range(shards)]
        parts = [_split_batch(item, shards, size) for item in batch]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return [type(batch)(*(p[i] for p in parts)) for i in range(shards)]
        return [type(batch)(p[i] for p in parts) for i in range(shards)]
    if isinstance(batch, dict):
        split = {key: _split_batch(value, shards, size) for key, value in batch.items()}
        return [{key: value[i] for key, value in split.items()} for i in range(shards)]
    return [batch] * shards


def _same_integer_buffers(exact: list[tuple[str, torch.Tensor]], first: list[torch.Tensor],
                          shard: int) -> None:
    """Integer buffers are not averaged: every shard must compute them alike (a step count).
    One that depends on the data would end each rank with its own last shard's value."""
    for (name, buffer), value in zip(exact, first):
        if not torch.equal(buffer, value):
            raise ValueError(
                f"VirtualShardDDP: the integer buffer '{name}' came out of virtual shard {shard} "
                "unlike the rank's first shard: integer buffers are not averaged, so one that "
                "depends on the data would differ between ranks and world sizes. Make it a "
                "floating-point buffer (averaged over the shards) or keep the count outside "
                "the model"
            )


def _unsupported(module: nn.Module) -> None:
    """Raise for modules whose result would depend on the world size."""
    from lockstep.ddp.wrapper import DistributedDataParallel

    wrappers = (DistributedDataParallel, nn.parallel.DistributedDataParallel)
    for name, sub in module.named_modules():
        where = name or "the module"
        if isinstance(sub, wrappers):
            raise TypeError(
                f"{where} is already a {type(sub).__name__}: pass the plain module to "
                f"VirtualShardDDP, which does its own gradient reduction"
            )
        if isinstance(sub, nn.SyncBatchNorm) or type(sub).__name__ == "SyncBatchNorm":
            raise ValueError(
                f"{where} is a SyncBatchNorm, whose statistics span the ranks of the moment: "
                f"use plain BatchNorm, which VirtualShardDDP normalises per virtual shard"
            )
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"{where} has sparse=True: VirtualShardDDP sums dense gradients only; "
                f"construct it with sparse=False"
            )


# torch.compile's machinery, which may read the rank while it compiles a submodule inside a
# shard; any other caller (the model, torch.nn.SyncBatchNorm) is refused.
_COMPILER_MODULES = ("torch._dynamo", "torch._logging", "torch._inductor", "torch._functorch",
                     "torch.fx", "torch._guards", "torch._subclasses", "torch._export")


@contextlib.contextmanager
def _rank_unreadable(where: str) -> Iterator[None]:
    """Make ``torch.distributed.get_rank``/``get_world_size`` raise while a shard runs.

    A forward that reads them would compute something that depends on the world; this is the
    one place the mode patches module attributes, restored in ``finally``.
    """
    import torch.distributed.distributed_c10d as c10d

    def refusing(original: Callable[..., int]) -> Callable[..., int]:
        def refuse(*args: Any, **kwargs: Any) -> int:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_COMPILER_MODULES):
                # torch.compile compiling a submodule on its first call, inside a shard, logs
                # the rank for itself (torch._logging), not for the model's result
                return original(*args, **kwargs)
            raise RuntimeError(
                f"{where} read the rank or world size during a virtual shard: with "
                f"virtual_shards the result must not depend on which rank runs a shard; use "
                f"the shard index (VirtualShardDDP.current_shard) instead"
            )
        return refuse

    saved = [(m, n, getattr(m, n)) for m in (dist, c10d) for n in ("get_rank", "get_world_size")]
    try:
        for owner, name, original in saved:
            setattr(owner, name, refusing(original))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like``, in order."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _launcher_set_threads() -> bool:
    """Did a launcher, not the user, set ``OMP_NUM_THREADS`` (``lockstep run`` marks its own;
    torchrun sets 1 for several workers, saying so, when the user set nothing)?"""
    marked = os.environ.get(OMP_FROM_LAUNCHER_ENV)  # lockstep run says either way
    if marked is not None:
        return marked == "1"
    return ("TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1"
            and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1)


def _warn_thread_count(virtual_shards: int) -> None:
    """Warn where this process's CPU thread count is one that another world size would not
    have: a CPU sum's bits depend on how many threads split it. ``lockstep run
    --virtual-shards V`` gives every worker ``cores // V`` threads at every world size; a
    process started otherwise (plain ``python`` takes every core, torchrun gives 1 thread per
    worker) computes other bits than a run at another world size. An ``OMP_NUM_THREADS`` the
    user set is taken as chosen for every run; one a launcher set (``lockstep run`` without
    ``--virtual-shards`` gives ``cores // nproc``, torchrun ``1``) is not."""
    want, have = threads_per_share(virtual_shards), torch.get_num_threads()
    if have == want or ("OMP_NUM_THREADS" in os.environ and not _launcher_set_threads()):
        return
    warnings.warn(
        f"VirtualShardDDP: this process computes on {have} CPU threads; runs at other world "
        f"sizes are bitwise equal to it only with the same count in every process, and "
        f"`lockstep run --virtual-shards {virtual_shards}` gives each worker {want} "
        f"(cores // virtual_shards). Set OMP_NUM_THREADS={want} for every run (or launch every "
        "run with `lockstep run --virtual-shards`)",
        stacklevel=3,
    )


class VirtualShardDDP(nn.Module):
    """Data parallelism whose result is bitwise the same on any world size dividing ``V``.

    Args:
        module: the model; parameters and buffers are broadcast from group rank 0.
        virtual_shards: ``V``, a power of two; the world size must divide it. ``None``: the
            ``V`` of ``lockstep run --virtual-shards V`` (``LOCKSTEP_VIRTUAL_SHARDS``).
        process_group: the ranks that share the work (``None``: the default group).
        seed: mixed with the step and shard index to seed each shard's RNG (dropout...).
        bucket_cap_mb: gradient bucket size; each bucket's reduction starts during the rank's
            last shard's backward (``0``: one reduction after backward). No bit depends on it.

    Example::

        model = VirtualShardDDP(net, virtual_shards=4)
        for step, batch in enumerate(loader):          # loader over a VirtualShardSampler
            optimizer.zero_grad()
            loss = model.train_step(split_shards(batch, model.shards_per_rank),
                                    lambda m, b: F.cross_entropy(m(b[0]), b[1]), step)
            optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        virtual_shards: int | None = None,
        *,
        process_group: Any = None,
        seed: int = 0,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        super().__init__()
        _unsupported(module)
        kinds = {(p.dtype, p.device) for p in module.parameters()}
        if len(kinds) > 1:
            raise ValueError(
                f"VirtualShardDDP needs every parameter in one dtype on one device, got "
                f"{sorted(str(k) for k in kinds)}: cast the model (e.g. model.float()) first"
            )
        self.module = module
        self.process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.virtual_shards = resolve_virtual_shards(virtual_shards)
        self.shards_per_rank = check_virtual_shards(self.virtual_shards, self.world_size)
        if any(device.type == "cpu" for _, device in kinds):
            _warn_thread_count(self.virtual_shards)
        self.seed = seed
        self.current_shard: int | None = None
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be 0 (no overlap) or more, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb
        self._buckets: ShardBuckets | None = None
        if self.world_size > 1:
            source = global_rank(process_group, 0)
            progress = group_progress(process_group)  # a rank that never comes is named
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    hang.run(progress, "VirtualShardDDP start-up broadcast from rank 0",
                             partial(dist.broadcast, tensor, source, group=process_group))

    def _bucketed(self, params: list[nn.Parameter]) -> ShardBuckets | None:
        """The bucketed, overlapped reduction for these parameters (``None`` in a world of one
        or with ``bucket_cap_mb=0``)."""
        if self.world_size == 1 or self.bucket_cap_mb <= 0 or not params:
            return None
        if self._buckets is None or [id(p) for p in self._buckets.params] != [id(p) for p in params]:
            elements = int(self.bucket_cap_mb * 2**20) // params[0].element_size()
            self._buckets = ShardBuckets(params, max(1, elements), self.world_size,
                                         self.process_group)
        return self._buckets

    @property
    def local_shards(self) -> range:
        """The global indices of the virtual shards this rank runs, in order."""
        first = self.rank * self.shards_per_rank
        return range(first, first + self.shards_per_rank)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix), as torch's DDP saves it."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module: the weights are those of any world size."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (evaluation, inference); training goes through
        :meth:`train_step`."""
        return self.module(*args, **kwargs)

    def _run_shard(
        self, shard: Any, index: int, step: int, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        params: list[nn.Parameter],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        self.current_shard = index
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(shard_seed(self.seed, step, index))
                # Only the forward and loss: backward's bucket hooks call collectives.
                with _rank_unreadable(
                    f"the forward or loss of virtual shard {index} (rank {self.rank})"
                ):
                    loss = loss_fn(self.module, shard)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(
                        f"loss_fn must return a one-element tensor (the shard's mean loss), got "
                        f"{type(loss).__name__} for virtual shard {index}"
                    )
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            self.current_shard = None
        return loss.detach().reshape(1), [
            torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)
        ]

    def train_step(
        self, shards: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], step: int
    ) -> torch.Tensor:
        """Run this rank's shards and set every parameter's ``.grad`` to the global mean gradient.

        Args:
            shards: this rank's ``shards_per_rank`` shard batches, in shard order
                (:func:`split_shards` of the sampler's batch).
            loss_fn: ``loss_fn(module, shard) -> loss``, the shard's mean loss.
            step: the optimizer step number (seeds each shard's RNG).

        Returns:
            The global mean loss (the tree mean of the ``V`` shard losses), bitwise the same at
            every world size.
        """
        if len(shards) != self.shards_per_rank:
            raise ValueError(
                f"rank {self.rank} got {len(shards)} shards, but runs {self.shards_per_rank} "
                f"(virtual_shards={self.virtual_shards} over {self.world_size} ranks)"
            )
        params = [p for p in self.module.parameters() if p.requires_grad]
        named = list(self.module.named_buffers())
        buffers = [b for _, b in named]
        floats = [b for b in buffers if b.is_floating_point()]
        exact = [(name, b) for name, b in named if not b.is_floating_point()]
        first: list[torch.Tensor] | None = None  # the first shard's integer buffers
        start = [b.detach().clone() for b in buffers]
        sums: dict[torch.dtype, TreeSum] = {}
        buckets = self._bucketed(params)
        if buckets is not None:
            buckets.begin()
        for shard, index in zip(shards, self.local_shards):
            with torch.no_grad():
                for buffer, value in zip(buffers, start):
                    buffer.copy_(value)
            last = index == self.local_shards[-1]
            # The last shard's buckets start reducing while its backward runs.
            handles = buckets.hooks() if buckets is not None and last else []
            try:
                loss, grads = self._run_shard(shard, index, step, loss_fn, params)
            finally:
                for handle in handles:
                    handle.remove()
            if first is None:
                first = [b.detach().clone() for _, b in exact]
            else:
                _same_integer_buffers(exact, first, index)
            if buckets is not None and not last:
                buckets.push(grads)
            # One flat vector per dtype (gradients unless bucketed, float buffers, the loss).
            rest = [*(b.detach() for b in floats), loss]
            for dtype, parts in _by_dtype(rest if buckets is not None else [*grads, *rest]).items():
                sums.setdefault(dtype, TreeSum()).push(_flat(parts))
        scale = 1.0 / self.virtual_shards  # exact: V is a power of two
        if buckets is not None:
            buckets.finish(scale)
        like = [*floats, loss] if buckets is not None else [*params, *floats, loss]
        totals = {
            dtype: iter(_split(combine_subtrees(acc.result(), self.world_size,
                                                self.process_group) * scale,
                               _by_dtype(like)[dtype]))
            for dtype, acc in sums.items()
        }
        if buckets is None:
            for p in params:
                p.grad = next(totals[p.dtype])  # views of one fresh buffer, like DDP's buckets
        with torch.no_grad():
            for b in floats:
                b.copy_(next(totals[b.dtype]))
        return next(totals[loss.dtype])[0]
