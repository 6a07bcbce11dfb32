"""One home for walking nested batches: tensors inside tuples, lists, dicts, namedtuples, dataclasses.

DataParallel's scatter, DDP's ``device_ids`` input move and the helper's loader all move a
user's batch to a device; they share this walk so that every one of them accepts the same
containers and treats them the same way.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["batch_size", "iter_tensors", "map_tensors", "move_to"]


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` with ``fn`` applied to every tensor; other leaves are kept as they are.

    Containers keep their type: tuples, lists, dicts (and their subclasses that take an
    iterable; others, such as ``defaultdict``, come back as plain dicts), namedtuples and
    dataclass instances (copied, every field mapped) and ``PackedSequence`` (its data mapped,
    its ``batch_sizes`` kept).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, PackedSequence):  # batch_sizes stay on the CPU, as PackedSequence.to keeps them
        data = map_tensors(obj.data, fn)
        if not isinstance(data, torch.Tensor):
            return obj
        return type(obj)(data, obj.batch_sizes,
                         *(None if i is None else i.to(data.device)
                           for i in (obj.sorted_indices, obj.unsorted_indices)))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: map_tensors(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:
            return type(obj)(mapped)
        except TypeError:  # a mapping whose constructor wants more (defaultdict): a plain dict
            return mapped
    if _is_dataclass_instance(obj):
        # A copy with every field mapped, those outside __init__ (init=False) too: rebuilding
        # through __init__ (dataclasses.replace) would reset them.
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, map_tensors(getattr(obj, f.name), fn))
        return new
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from iter_tensors(value)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def batch_size(obj: Any, dim: int = 0) -> int | None:
    """Samples in a batch: the size along ``dim`` of its first tensor that has a ``dim``.

    Walks what :func:`iter_tensors` walks (dataclasses included); scalar tensors (a 0-dim
    flag or weight in front of the data) are skipped. None when no tensor has that dimension.
    """
    for tensor in iter_tensors(obj):
        if tensor.dim() > dim:
            return int(tensor.size(dim))
    return None


def move_to(obj: Any, device: torch.device | str, non_blocking: bool | None = None) -> Any:
    """Move every tensor inside ``obj`` to ``device``.

    Args:
        obj: a tensor, or a nest of tuples, lists, dicts, namedtuples and dataclasses.
        device: where the tensors go.
        non_blocking: passed to ``Tensor.to``; None means "when the target is CUDA" (an
            asynchronous host-to-device copy, which only pinned memory makes truly async).
    """
    device = torch.device(device)
    nb = device.type == "cuda" if non_blocking is None else non_blocking
    return map_tensors(obj, lambda t: t.to(device, non_blocking=nb))
