"""Scatter inputs across devices and gather outputs back, through nested containers.

Tensors are split along ``dim`` into one chunk per replica; tuples, lists, dicts, named tuples
and dataclasses are walked by :mod:`lockstep.tensors` (the one walk every module shares); any
other value goes to every replica unchanged. Every move goes through ``Tensor.to`` and
``torch.cat``, so autograd follows it both ways. What is DataParallel's own lives here: chunking,
and gather's walk over every replica's output at once, which also names the path of a culprit
(``inputs[0]['x']``) in error messages.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from lockstep.dp.devices import DeviceLike, as_device
from lockstep.tensors import iter_tensors, map_tensors, move_to

__all__ = [
    "count_replicas",
    "gather",
    "iter_tensors",
    "move_to_device",
    "named_tensors",
    "scatter",
    "scatter_kwargs",
]


def _rebuild(obj: Any, fn: Callable[[str, Any, Any], Any]) -> Any:
    """``obj`` rebuilt from ``fn(label, key, member)`` per member; ``obj`` if not a container.

    ``label`` names the member for error messages (``[0]``, ``['x']``, ``.field``); ``key`` fetches
    it from a structure of the same shape (see :func:`_member`). This is gather's own walk: it
    visits every replica's output in step, member by member, and names paths; a walk over one
    structure uses :mod:`lockstep.tensors` instead.
    """
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(fn(f".{name}", i, v) for i, (name, v) in enumerate(zip(obj._fields, obj))))
    if isinstance(obj, (tuple, list)):
        return type(obj)(fn(f"[{i}]", i, v) for i, v in enumerate(obj))
    if isinstance(obj, dict):
        items = {k: fn(f"[{k!r}]", k, v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # a mapping type whose constructor wants more (defaultdict...)
            return items
    if _is_dataclass_instance(obj):
        # A copy with every field rebuilt, init=False ones too (as lockstep.tensors does):
        # dataclasses.replace would reset those (until 2026-11-29 gather dropped them).
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, fn(f".{f.name}", f.name, getattr(obj, f.name)))
        return new
    return obj


def _member(obj: Any, key: Any) -> Any:
    """The member of ``obj`` that :func:`_rebuild` passed with ``key``."""
    return getattr(obj, key) if _is_dataclass_instance(obj) else obj[key]


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_container(obj: Any) -> bool:
    return isinstance(obj, (tuple, list, dict)) or _is_dataclass_instance(obj)


def named_tensors(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` with its path (``args[0]['x']``), for error messages."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    found: list[tuple[str, torch.Tensor]] = []

    def visit(label: str, _: Any, value: Any) -> Any:
        found.extend(named_tensors(value, path + label))
        return value

    _rebuild(obj, visit)
    return found


def count_replicas(obj: Any, n_devices: int, dim: int = 0) -> int:
    """How many replicas a scatter of ``obj`` feeds: one per device, fewer for a small batch.

    Raises:
        ValueError: a tensor to split has no dimension ``dim`` or is empty along it.
    """
    if _holds_packed(obj):
        raise ValueError(
            "cannot scatter a PackedSequence: its rows are interleaved by time step, so no "
            "slice of it is a batch of whole sequences. Pass the padded tensor and the lengths, "
            "and pack inside forward (torch.nn.utils.rnn.pack_padded_sequence)"
        )
    sizes = [n_devices]
    for tensor in iter_tensors(obj):
        if tensor.dim() == 0:
            continue  # scalars go to every replica whole
        if not -tensor.dim() <= dim < tensor.dim() or tensor.size(dim) == 0:
            _raise_unsplittable(obj, dim)
        sizes.append(tensor.size(dim))
    return min(sizes)


def _holds_packed(obj: Any) -> bool:
    if isinstance(obj, PackedSequence):
        return True
    if isinstance(obj, dict):
        return any(_holds_packed(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_packed(v) for v in obj)
    return False


def _raise_unsplittable(obj: Any, dim: int) -> None:
    """Raise ValueError naming the first tensor of ``obj`` that cannot be split along ``dim``."""
    for path, tensor in named_tensors(obj, "inputs"):
        if tensor.dim() == 0:
            continue
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"cannot scatter {path} (shape {tuple(tensor.shape)}) along dim={dim}; "
                             "pass a dim every input tensor has")
        if tensor.size(dim) == 0:
            raise ValueError(f"cannot scatter {path}: it is empty along dim={dim}")


def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """Split ``inputs`` into one piece per replica, each moved to its device.

    Chunks differ in size by at most one along ``dim``; a batch smaller than the device count
    feeds only as many replicas as it has samples. Scalars and non-tensors go to every replica.

    Args:
        inputs: a tensor, or tuples/lists/dicts/dataclasses holding tensors.
        target_devices: the devices, in replica order.
        dim: the dimension to split along.

    Returns:
        One copy of the structure of ``inputs`` per replica.

    Example:
        >>> scatter((torch.arange(5),), ["cpu", "cpu"])
        [(tensor([0, 1, 2]),), (tensor([3, 4]),)]
    """
    devices = [as_device(d) for d in target_devices]
    n = count_replicas(inputs, len(devices), dim)
    return [_piece(inputs, i, n, dev, dim) for i, dev in enumerate(devices[:n])]


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_devices: Sequence[DeviceLike],
    dim: int = 0,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Scatter positional and keyword arguments together, so both feed the same replicas."""
    both = scatter((tuple(inputs), dict(kwargs or {})), target_devices, dim)
    return [args for args, _ in both], [kw for _, kw in both]


def _piece(obj: Any, index: int, n: int, device: torch.device, dim: int) -> Any:
    # Chunks after the first that stay on their tensor's device (a CPU list, a repeated GPU)
    # are copied while autograd records: views of one input share its version counter, so a
    # forward that writes its input in place (ReLU(inplace=True) first) would invalidate what
    # the other replicas saved. torch's chunks on other GPUs are copies too; the first stays a
    # view, as torch's does. Until 2026-11-29 every chunk was a view and such forwards failed.
    own_memory = index > 0 and torch.is_grad_enabled()

    def chunk(tensor: torch.Tensor) -> torch.Tensor:
        part = tensor if tensor.dim() == 0 else torch.tensor_split(tensor, n, dim)[index]
        moved = part.to(device, non_blocking=True)
        return moved.clone() if own_memory and moved is part and tensor.dim() else moved

    return map_tensors(obj, chunk)


def move_to_device(obj: Any, device: DeviceLike) -> Any:
    """``obj`` with every tensor inside moved to ``device`` (no split): the one-replica scatter.

    :func:`lockstep.tensors.move_to` with DataParallel's device names (``-1`` is the CPU).
    """
    return move_to(obj, as_device(device))


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-replica outputs on ``target_device`` along ``dim``, through containers.

    Scalar tensors (a loss computed inside ``forward``) cannot be concatenated: they come back
    as a vector with one entry per replica, with a warning, as torch's DataParallel does.
    Non-tensor values equal on every replica come back once, others as a list per replica.

    Raises:
        ValueError: replicas returned different structures (dict keys, lengths, types).

    Example:
        >>> gather([torch.zeros(2), torch.ones(1)], "cpu")
        tensor([0., 0., 1.])
    """
    return _gather(list(outputs), as_device(target_device), dim, "output")


def _gather(values: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"replicas returned a tensor and a non-tensor at {path}")
        moved = [v.to(device) for v in values]
        if all(v.dim() == 0 for v in moved):
            warnings.warn(
                f"gathering scalars at {path}: returning a vector with one value per replica "
                "(average it for a mean loss, or use DataParallel(loss_fn=...))",
                stacklevel=4,
            )
            return torch.stack(moved)
        return torch.cat(moved, dim)
    if first is None or not _is_container(first):
        if any(isinstance(v, torch.Tensor) or _is_container(v) for v in values):
            # None on one replica, a tensor on another (a branch taken for some chunks only):
            # the same error whichever replica had which (torch keeps replica 0's None)
            raise ValueError(f"replicas returned a tensor and a non-tensor at {path}")
        return _gather_plain(values)
    _check_same_shape(values, path)

    def member(label: str, key: Any, _: Any) -> Any:
        return _gather([_member(v, key) for v in values], device, dim, path + label)

    return _rebuild(first, member)


def _check_same_shape(values: list[Any], path: str) -> None:
    first = values[0]
    for i, v in enumerate(values[1:], start=1):
        if type(v) is not type(first):
            raise ValueError(
                f"replica 0 returned {type(first).__name__} at {path} but replica {i} returned "
                f"{type(v).__name__}; forward must return the same structure on every replica"
            )
        # Keys are looked up by name, in replica 0's order, as torch's gather does: the same
        # keys inserted in another order are fine (until 2026-11-29 they raised).
        if isinstance(first, dict) and v.keys() != first.keys():
            raise ValueError(
                f"replicas returned different keys at {path}: {list(first)} vs {list(v)}"
            )
        if isinstance(first, (tuple, list)) and len(v) != len(first):
            raise ValueError(
                f"replicas returned different lengths at {path}: {len(first)} vs {len(v)}"
            )


def _gather_plain(values: list[Any]) -> Any:
    try:
        if all(v is values[0] or bool(v == values[0]) for v in values):
            return values[0]
    except (TypeError, ValueError, RuntimeError):  # values whose == is not a plain bool
        pass
    return list(values)
