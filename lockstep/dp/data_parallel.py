"""DataParallel: one process driving several devices, a drop-in for ``torch.nn.DataParallel``.

Each forward is a pipeline of four steps, each its own module: scatter the batch, replicate the
model, run the replicas in parallel threads, gather the outputs. Beyond torch's class:

* ``loss_fn``: the loss is computed on every replica beside its outputs and only the scalar
  losses travel to ``output_device``, so device 0 no longer holds everyone's outputs.
* Under ``torch.no_grad()`` replicas are cached and refreshed only when the model changed.
* CPU device lists (``['cpu', 'cpu']``) run replicas in threads, so the path is testable anywhere.

Example:
    >>> model = DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    >>> model(torch.randn(8, 4)).shape
    torch.Size([8, 2])
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lockstep.doctor.dp_recorder import DataParallelRecorder
from lockstep.dp.balance import device_capacities, imbalance_message
from lockstep.dp.parallel_apply import parallel_apply
from lockstep.dp.replica_cache import ReplicaCache
from lockstep.dp.replicate import check_module_device, replicate
from lockstep.dp.scatter_gather import (
    DeviceLike,
    _as_device,
    _leaves,
    gather,
    iter_tensors,
    move_to_device,
    scatter,
)

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

    Raises:
        ValueError: ``device_ids`` is empty, mixes device types, or names a missing device.

    Example:
        >>> model = DataParallel(net, device_ids=[0, 1], loss_fn=nn.CrossEntropyLoss())
        >>> loss = model(images, targets=labels)  # outputs stay on their devices
        >>> loss.backward()
    """

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
        super().__init__()
        self.module = module
        self.device_ids = resolve_device_ids(device_ids)
        self.src_device_obj = self.device_ids[0]
        self.output_device = _resolve_output_device(output_device, self.src_device_obj)
        self.dim = dim
        # Kept out of the submodules on purpose: the loss is not part of the model's state_dict.
        self.__dict__["loss_fn"] = loss_fn
        self.loss_reduction = _resolve_reduction(loss_fn, loss_reduction)
        self.gather_outputs = gather_outputs
        self.cache_replicas = cache_replicas
        self._model_cache = ReplicaCache()
        self._loss_cache = ReplicaCache()
        self._profiler: DataParallelRecorder | None = None  # enable_profiling()
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
        if len(self.device_ids) == 1:
            if any(t.device != src for t in tensors):
                inputs, kwargs, targets = move_to_device((inputs, kwargs, targets), src)
            return self._forward_one(inputs, kwargs, targets)
        return self._forward_many(inputs, kwargs, targets)

    def _forward_many(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any) -> Any:
        """scatter -> replicate -> parallel_apply -> gather (or combine the replicas' losses)."""
        prof = self._profiler if torch.is_grad_enabled() else None
        if prof is not None:
            prof.forward_started()
        pieces = scatter((inputs, kwargs, targets), self.device_ids, self.dim)
        devices = self.device_ids[: len(pieces)]
        if prof is not None:
            prof.mark("scatter")
        models, loss_fns = self._replicas(devices, targets)
        calls = [functools.partial(_run_replica, m, l) for m, l in zip(models, loss_fns)]
        if prof is not None:
            prof.mark("replicate")
            calls = [prof.timed_call(i, c) for i, c in enumerate(calls)]
        results = parallel_apply(calls, [(p,) for p in pieces], devices=devices)
        if prof is not None:
            prof.mark("parallel_apply")
        result = self._gather_results(results, pieces, targets)
        if prof is not None:
            prof.mark("gather")
            prof.forward_ended(result)
        return result

    def _gather_results(self, results: list[Any], pieces: list[Any], targets: Any) -> Any:
        outputs = [out for _, out in results]
        if targets is None:
            return gather(outputs, self.output_device, self.dim)
        sizes = [_batch_size(p, self.dim) for p in pieces]
        loss = combine_losses([loss for loss, _ in results], sizes, self.loss_reduction,
                              self.output_device, self.dim)
        if self.gather_outputs:
            return loss, gather(outputs, self.output_device, self.dim)
        return loss

    def enable_profiling(self, enabled: bool = True, warmup: int = 3) -> DataParallelRecorder | None:
        """Time scatter, replicate, each device's forward, gather, backward and the optimizer.

        Returns:
            The :class:`~lockstep.doctor.dp_recorder.DataParallelRecorder` (its ``phases()``
            gives seconds per step), or None when disabled.
        """
        if self._profiler is not None:
            self._profiler.close()
        self._profiler = None
        if enabled:
            self._profiler = DataParallelRecorder(self.module.parameters(), len(self.device_ids),
                                                  warmup)
        return self._profiler

    @property
    def profiler(self) -> DataParallelRecorder | None:
        return self._profiler

    def _forward_one(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any) -> Any:
        # One device: no replicas, no threads, the module called as it is.
        loss, out = _run_replica(self.module, self.loss_fn, (inputs, kwargs, targets))
        if targets is None:
            if self.output_device == self.src_device_obj:
                return out
            return gather([out], self.output_device, self.dim)
        loss = combine_losses([loss], [1], self.loss_reduction, self.output_device, self.dim)
        return (loss, gather([out], self.output_device, self.dim)) if self.gather_outputs else loss

    def _replicas(self, devices: list[torch.device], targets: Any) -> tuple[list[Any], list[Any]]:
        """Model replicas and loss-function replicas (the same object where it holds no tensors)."""
        caching = self.cache_replicas and not torch.is_grad_enabled()
        if not caching:
            # A training forward builds its own replicas; free inference copies meanwhile.
            self.clear_replica_cache()
        models = self._copies(self.module, self._model_cache, devices, caching)
        loss_fn = self.loss_fn if targets is not None else None
        if not isinstance(loss_fn, nn.Module) or not _has_tensors(loss_fn):
            return models, [loss_fn] * len(devices)
        check_module_device(loss_fn, self.src_device_obj)
        return models, self._copies(loss_fn, self._loss_cache, devices, caching)

    def _copies(
        self, module: nn.Module, cache: ReplicaCache, devices: list[torch.device], caching: bool
    ) -> list[nn.Module]:
        if caching:
            # Cached for every device, so a short last batch (fewer replicas) reuses them too.
            return cache.get(module, self.device_ids)[: len(devices)]
        return replicate(module, devices, detach=not torch.is_grad_enabled())

    def _raise_input_device(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: Any
    ) -> None:
        """Raise ValueError naming the input on a device type this wrapper does not drive."""
        driven = self.src_device_obj.type
        for path, tensor in _leaves({"args": inputs, "kwargs": kwargs, "targets": targets}, "inputs"):
            if tensor.device.type not in (driven, "cpu"):
                raise ValueError(
                    f"{path} is on {tensor.device} but this DataParallel drives {driven} devices "
                    f"{[str(d) for d in self.device_ids]}; move the input to {driven} (or to the CPU)"
                )

    def clear_replica_cache(self) -> None:
        """Drop cached inference replicas: needed only after writing parameters through ``.data``."""
        self._model_cache.clear()
        self._loss_cache.clear()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state_dict, without a ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Accept both the bare module's keys and the wrapper's ``module.``-prefixed ones: rename
        # bare keys in place, before nn.Module's loader hands them on to self.module.
        mine = [k for k in state_dict if k.startswith(prefix)]
        if mine and not all(k.startswith(prefix + "module.") for k in mine):
            for key in mine:
                state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        return f"device_ids=[{devices}], output_device={self.output_device}, dim={self.dim}"


def _run_replica(
    model: Callable[..., Any], loss_fn: Callable[..., Any] | None, piece: Any
) -> tuple[Any, Any]:
    """Forward one replica on its piece ``(args, kwargs, targets)``, and its loss if targets exist."""
    args, kwargs, targets = piece
    out = model(*args, **kwargs)
    if targets is None or loss_fn is None:
        return None, out
    return loss_fn(out, targets), out


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
        for _, tensor in _leaves(obj):
            if tensor.dim() > 0:
                return tensor.size(dim)
    return 1


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def resolve_device_ids(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    """``device_ids`` as devices, checked: one device type, every device present.

    Raises:
        ValueError: empty, mixed types, a device type other than cpu/cuda, or a missing GPU.
    """
    if device_ids is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    try:
        devices = [_as_device(d) for d in device_ids]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device_ids={list(device_ids)!r} holds something that is not a device: {exc}"
        ) from exc
    if not devices:
        raise ValueError(
            "device_ids is empty; pass at least one device, e.g. [0, 1] or ['cpu', 'cpu']"
        )
    types = sorted({d.type for d in devices})
    if len(types) > 1:
        raise ValueError(f"device_ids mixes device types {types}; one DataParallel drives one kind "
                         "of device (use only GPUs, or only 'cpu')")
    if types[0] == "cpu":
        return [torch.device("cpu") for _ in devices]
    if types[0] != "cuda":
        raise ValueError(f"DataParallel drives 'cuda' or 'cpu' devices, not {types[0]!r}")
    return [_check_cuda(d) for d in devices]


def _check_cuda(device: torch.device) -> torch.device:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.index if device.index is not None else (torch.cuda.current_device() if count else 0)
    if index >= count:
        raise ValueError(f"device_ids names cuda:{index} but {count} CUDA device(s) are visible; "
                         "check CUDA_VISIBLE_DEVICES or pass existing indices")
    return torch.device("cuda", index)


def _resolve_output_device(output_device: DeviceLike | None, src: torch.device) -> torch.device:
    if output_device is None:
        return src
    device = _as_device(output_device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != src.type:
        raise ValueError(f"output_device={output_device!r} is neither the CPU nor a {src.type} device "
                         "like device_ids; pass one of device_ids or -1 for the CPU")
    return _check_cuda(device)


def _resolve_reduction(loss_fn: Any, loss_reduction: str | None) -> str:
    reduction = loss_reduction or getattr(loss_fn, "reduction", None) or "mean"
    if reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction={reduction!r} is not one of {_REDUCTIONS}")
    return reduction
