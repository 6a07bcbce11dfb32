"""DataParallel: one process driving several devices, a drop-in for ``torch.nn.DataParallel``.

Each forward is a pipeline of four steps, each its own module and each a method a subclass may
override as with torch's class: scatter the batch, replicate the model, run the replicas in
parallel threads, gather the outputs. Beyond torch's class:

* ``loss_fn``: the loss is computed on every replica beside its outputs and only the scalar
  losses travel to ``output_device``, so device 0 no longer holds everyone's outputs.
* Under ``torch.no_grad()`` replicas are cached and refreshed only when the model changed.
* CPU device lists (``['cpu', 'cpu']``) run replicas in threads, so the path is testable
  anywhere. In training mode the threads take turns in replica order, so random draws
  (dropout) are reproducible and equal to the module's run on each chunk in turn; in eval mode
  they run at the same time.

Example:
    >>> model = DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    >>> model(torch.randn(8, 4)).shape
    torch.Size([8, 2])
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lockstep import profilers
from lockstep.dp.balance import device_capacities, imbalance_message
from lockstep.dp.devices import (
    DeviceLike,
    as_device,
    cuda_asked_without_cuda,
    resolve_device_ids,
    resolve_output_device,
)
from lockstep.dp.observer import DataParallelObserver
from lockstep.dp.parallel_apply import parallel_apply
from lockstep.dp.replica_cache import ReplicaCache, cacheable
from lockstep.dp.replicate import check_module_device, replicate
from lockstep.dp.scatter_gather import gather, named_tensors, scatter_kwargs
from lockstep.tensors import batch_size, iter_tensors, move_to
from lockstep.wrappers import called_by_holder

__all__ = ["DataParallel", "resolve_device_ids"]

logger = logging.getLogger(__name__)

_REDUCTIONS = ("mean", "sum", "none")


class DataParallel(nn.Module):
    """Split each batch across devices, run one replica per device, and bring the results back.

    Args:
        module: the model, on ``device_ids[0]``.
        device_ids: CUDA indices or devices (``[0, 1]``, ``['cuda:0', 'cuda:1']``), or a CPU list
            such as ``['cpu', 'cpu']``; default every visible GPU, else the CPU.
        output_device: where outputs (or the loss) are gathered; default ``device_ids[0]``,
            ``-1`` for the CPU.
        dim: the batch dimension inputs are split along and outputs joined along.
        loss_fn: if given, calling the wrapper with ``targets=`` returns ``loss_fn(outputs,
            targets)`` computed per replica and combined on ``output_device``.
        loss_reduction: how per-replica losses combine: ``'mean'`` (weighted by each replica's
            batch share), ``'sum'``, or ``'none'`` (per-sample losses gathered along ``dim``);
            default ``loss_fn.reduction`` when it has one, else ``'mean'``.
        gather_outputs: in loss mode, also gather the full outputs and return ``(loss, outputs)``.
        cache_replicas: reuse replicas between forwards run under ``torch.no_grad()``.

    The forward is torch's pipeline of four methods, each overridable by a subclass as with
    ``torch.nn.DataParallel``: :meth:`scatter`, :meth:`replicate`, :meth:`parallel_apply`,
    :meth:`gather`. In loss mode ``targets`` travels through :meth:`scatter` as a keyword
    argument, and the callables handed to :meth:`parallel_apply` return ``(loss, outputs)``.

    Random numbers on a CPU device list: while any submodule is in training mode, replicas run
    one after another in replica order, each continuing torch's CPU generator where the previous
    one stopped (see :mod:`lockstep.dp.cpu_rng`): runs are reproducible, replicas never share a
    dropout mask, and the result is bit for bit the module's run on each chunk in turn. In eval
    mode they run at the same time (one core each) and share the generator.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``device_ids`` is empty, mixes device types, or names a missing device.

    Example:
        >>> model = DataParallel(net, device_ids=[0, 1], loss_fn=nn.CrossEntropyLoss())
        >>> loss = model(images, targets=labels)  # outputs stay on their devices
        >>> loss.backward()
    """

    loss_fn: Callable[[Any, Any], torch.Tensor] | None

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        loss_reduction: str | None = None,
        gather_outputs: bool = False,
        cache_replicas: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            shown = repr(module)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise TypeError(
                f"DataParallel wraps an nn.Module, but was given {type(module).__name__} {shown}; "
                "pass the model itself, e.g. DataParallel(model, device_ids=[0, 1])"
            )
        super().__init__()
        self.module = module
        if cuda_asked_without_cuda(device_ids, output_device):
            warnings.warn(
                f"DataParallel(device_ids={device_ids if device_ids is None else list(device_ids)!r}, "
                f"output_device={output_device!r}) "
                "names CUDA devices, but CUDA is not available: the module runs on the CPU as it is, "
                "as torch.nn.DataParallel does. Check CUDA_VISIBLE_DEVICES and the torch build if "
                "GPUs were meant", stacklevel=2)
            device_ids, output_device = None, None
        self.device_ids = resolve_device_ids(device_ids)
        self.src_device_obj = self.device_ids[0]
        self.output_device = resolve_output_device(output_device, self.src_device_obj)
        self.dim = dim
        # Kept out of the submodules on purpose: the loss is not part of the model's state_dict.
        self.__dict__["loss_fn"] = loss_fn
        self.loss_reduction = _resolve_reduction(loss_fn, loss_reduction)
        self.gather_outputs = gather_outputs
        self.cache_replicas = cache_replicas
        self._model_cache = ReplicaCache()
        self._loss_cache = ReplicaCache()
        self._profiler: DataParallelObserver | None = None  # enable_profiling()
        message = imbalance_message(device_capacities(self.device_ids))
        if message:
            warnings.warn(message, stacklevel=2)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        targets = kwargs.pop("targets", None) if self.loss_fn is not None else None
        src = self.src_device_obj
        check_module_device(self.module, src)
        tensors = list(iter_tensors((inputs, kwargs, targets)))
        if any(t.device.type not in (src.type, "cpu") for t in tensors):
            self._raise_input_device(inputs, kwargs, targets)
        if len(self.device_ids) > 1:
            return self._forward_many(inputs, kwargs, targets)
        if type(self).scatter is not DataParallel.scatter:
            inputs, kwargs, targets = self._scatter(inputs, kwargs, targets, self.device_ids)[0]
        elif any(t.device != src for t in tensors):
            inputs, kwargs, targets = move_to((inputs, kwargs, targets), src)
        return self._forward_one(inputs, kwargs, targets)

    # --- torch's overridable steps -----------------------------------------------------------
    # Inside these methods the bare names are the module-level functions of lockstep.dp.

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """Split positional and keyword arguments into one piece per replica (see :func:`scatter_kwargs`)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """One replica of ``module`` per device, the first being ``module`` itself.

        Under ``torch.no_grad()`` with ``cache_replicas``, the model's (and loss_fn's) replicas
        are reused while the module is unchanged.
        """
        devices = [as_device(d) for d in device_ids]
        cache = {id(self.module): self._model_cache, id(self.loss_fn): self._loss_cache}.get(id(module))
        caching = (self.cache_replicas and not torch.is_grad_enabled() and cache is not None
                   and cacheable(module))
        if caching and devices == self.device_ids[: len(devices)]:
            # Cached for every device, so a short last batch (fewer replicas) reuses them too.
            assert cache is not None
            return cache.get(module, self.device_ids)[: len(devices)]
        return replicate(module, devices, detach=not torch.is_grad_enabled())

    def parallel_apply(
        self, replicas: Sequence[Callable[..., Any]], inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]]
    ) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])``, each in its own thread on its device.

        On a CPU device list, while any submodule is in training mode (dropout active), the
        replicas take turns in replica order so that random draws are reproducible; in eval
        mode they run at the same time, one core each.
        """
        devices = self.device_ids[: len(replicas)]
        # Short-circuits at the root in training mode; in eval mode it scans, as the replica
        # cache's key does anyway.
        training = any(m.training for m in self.module.modules())
        return parallel_apply(replicas, inputs, kwargs, devices, cpu_in_order=training)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Join the replicas' outputs on ``output_device`` along ``dim`` (see :func:`gather`)."""
        return gather(outputs, output_device, dim=self.dim)

    # --- the pipeline --------------------------------------------------------------------------

    def _scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any, devices: Sequence[torch.device]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any], Any]]:
        """:meth:`scatter` with ``targets`` carried as a keyword, split back out of every piece."""
        if not inputs and not kwargs and targets is None:
            return [((), {}, None)]  # nothing to split (torch's rule): one call, on the first device
        if targets is not None:
            kwargs = {**kwargs, "targets": targets}
        args_list, kwargs_list = self.scatter(inputs, kwargs, devices)
        if not args_list and not kwargs_list:  # nothing to split (torch's rule): one empty call
            args_list, kwargs_list = [()], [{}]
        pieces = []
        for args, kw in zip(args_list, kwargs_list):
            kw = dict(kw)
            piece_targets = kw.pop("targets", None) if targets is not None else None
            pieces.append((tuple(args), kw, piece_targets))
        return pieces

    def _forward_many(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any) -> Any:
        """scatter -> replicate -> parallel_apply -> gather (or combine the replicas' losses)."""
        prof = self._profiler if torch.is_grad_enabled() else None
        if prof is not None:
            prof.forward_started()
        pieces = self._scatter(inputs, kwargs, targets, self.device_ids)
        devices = self.device_ids[: len(pieces)]
        if prof is not None:
            prof.mark("scatter")
        if not (self.cache_replicas and not torch.is_grad_enabled()):
            # A training forward builds its own replicas; free inference copies meanwhile.
            self.clear_replica_cache()
        models = self.replicate(self.module, devices)
        if prof is not None:
            prof.mark("replicate")
        args_list = [args for args, _, _ in pieces]
        calls: list[Any] = list(models)
        kwargs_list = [kw for _, kw, _ in pieces]
        if targets is not None:
            calls = [_WithLoss(m, fn) for m, fn in zip(models, self._loss_replicas(devices))]
            kwargs_list = [{**kw, "targets": t} for _, kw, t in pieces]
        if prof is not None:
            calls = [prof.timed_call(i, c) for i, c in enumerate(calls)]
        results = self.parallel_apply(calls, args_list, kwargs_list)
        if prof is not None:
            prof.mark("parallel_apply")
        result = self._gather_results(results, pieces, targets)
        if prof is not None:
            prof.mark("gather")
            prof.forward_ended(result)
        return result

    def _gather_results(self, results: list[Any], pieces: list[Any], targets: Any) -> Any:
        if targets is None:
            return self.gather(results, self.output_device)
        sizes = [_batch_size(piece, self.dim) for piece in pieces]
        loss = combine_losses([loss for loss, _ in results], sizes, self.loss_reduction,
                              self.output_device, self.dim)
        if self.gather_outputs:
            return loss, self.gather([out for _, out in results], self.output_device)
        return loss

    def enable_profiling(self, enabled: bool = True, warmup: int = 3) -> DataParallelObserver | None:
        """Time scatter, replicate, each device's forward, gather, backward and the optimizer.

        Returns:
            The recorder, the doctor's :class:`~lockstep.doctor.dp_recorder.DataParallelRecorder`
            (its ``phases()`` gives seconds per step; built through :mod:`lockstep.profilers`),
            or None when disabled.
        """
        if self._profiler is not None:
            self._profiler.close()
        self._profiler = None
        if enabled:
            self._profiler = profilers.current().dp(self.module.parameters(),
                                                    len(self.device_ids), warmup)
        return self._profiler

    @property
    def profiler(self) -> DataParallelObserver | None:
        return self._profiler

    def _forward_one(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any) -> Any:
        # One device: no replicas, no threads, the module called as it is.
        if targets is None:
            out = self.module(*inputs, **kwargs)
            if self.output_device == self.src_device_obj:
                return out
            return self.gather([out], self.output_device)
        loss, out = _WithLoss(self.module, self.loss_fn)(*inputs, targets=targets, **kwargs)
        loss = combine_losses([loss], [1], self.loss_reduction, self.output_device, self.dim)
        return (loss, self.gather([out], self.output_device)) if self.gather_outputs else loss

    def _loss_replicas(self, devices: list[torch.device]) -> list[Any]:
        """Replicas of loss_fn: the same object on every device where it holds no tensors."""
        loss_fn = self.loss_fn
        if not isinstance(loss_fn, nn.Module) or not _has_tensors(loss_fn):
            return [loss_fn] * len(devices)
        check_module_device(loss_fn, self.src_device_obj)
        return self.replicate(loss_fn, devices)

    def _raise_input_device(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any
    ) -> None:
        """Raise ValueError naming the input on a device type this wrapper does not drive."""
        driven = self.src_device_obj.type
        everything = {"args": inputs, "kwargs": kwargs, "targets": targets}
        for path, tensor in named_tensors(everything, "inputs"):
            if tensor.device.type not in (driven, "cpu"):
                raise ValueError(
                    f"{path} is on {tensor.device} but this DataParallel drives {driven} devices "
                    f"{[str(d) for d in self.device_ids]}; move the input to {driven} (or to the CPU)"
                )

    def clear_replica_cache(self) -> None:
        """Drop cached inference replicas: needed only after writing parameters through ``.data``."""
        self._model_cache.clear()
        self._loss_cache.clear()

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The wrapped module's state_dict, without a ``module.`` prefix.

        Called by a module that holds this one (a container, ``AveragedModel``, passing its
        ``destination`` and a prefix) or with torch's old positional arguments, it gives torch's
        keys, ``module.`` included (``holder.dp.module.weight``), as lockstep's DDP does (until
        2026-11-29 the holder's keys lacked it and did not load into torch's DataParallel).
        """
        if called_by_holder(args, destination, prefix):
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Accept both the bare module's keys and the wrapper's ``module.``-prefixed ones: rename
        # bare keys in place, before nn.Module's loader hands them on to self.module.
        mine = [k for k in state_dict if k.startswith(prefix)]
        bare = mine and {k[len(prefix):] for k in mine} <= set(self.module.state_dict())
        if mine and (bare or not all(k.startswith(prefix + "module.") for k in mine)):
            for key in mine:
                state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        return f"device_ids=[{devices}], output_device={self.output_device}, dim={self.dim}"


class _WithLoss:
    """A replica and its loss: ``(loss_fn(outputs, targets), outputs)`` from one call."""

    def __init__(self, model: Callable[..., Any], loss_fn: Callable[..., Any] | None) -> None:
        self.model, self.loss_fn = model, loss_fn

    def __call__(self, *args: Any, targets: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        out = self.model(*args, **kwargs)
        if targets is None or self.loss_fn is None:
            return None, out
        return self.loss_fn(out, targets), out


def combine_losses(
    losses: list[torch.Tensor], sizes: list[int], reduction: str, device: torch.device, dim: int
) -> torch.Tensor:
    """One loss from per-replica losses: batch-weighted mean, sum, or per-sample concatenation."""
    if reduction == "none":
        return gather(losses, device, dim)
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn returned {shape} on replica {i}, not a scalar, with loss_reduction="
                f"{reduction!r}; reduce it inside loss_fn or pass loss_reduction='none'"
            )
    if len(losses) == 1:
        return losses[0].to(device)
    if reduction == "sum":
        return torch.stack([loss.to(device) for loss in losses]).sum()
    # Each replica's mean covers its own share of the batch; weighting by that share gives the
    # full-batch mean even when the chunks are uneven. Python-float weights: building a weight
    # tensor on a GPU would be a host-to-device copy that makes the CPU wait for the forward.
    total = sum(sizes)
    return torch.stack([loss.to(device) * (size / total) for loss, size in zip(losses, sizes)]).sum()


def _batch_size(piece: Any, dim: int) -> int:
    """Samples in one replica's piece: the size along ``dim`` of its first splittable tensor."""
    _, _, targets = piece
    for obj in (targets, piece):
        size = batch_size(obj, dim)
        if size is not None:
            return size
    return 1


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _resolve_reduction(loss_fn: Any, loss_reduction: str | None) -> str:
    reduction = loss_reduction or getattr(loss_fn, "reduction", None) or "mean"
    if reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction={reduction!r} is not one of {_REDUCTIONS}")
    return reduction
