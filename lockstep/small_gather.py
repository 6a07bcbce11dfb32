"""Gathering a small picklable value from every rank in one collective.

``torch.distributed.all_gather_object`` takes two collectives (the sizes, then the bytes). The
values lockstep agrees on before a checkpoint (a directory and a step, an error message or
``None``, a flag) pickle to a few dozen bytes, so here each rank sends a fixed-size slot, and
only when some rank's value does not fit do all of them fall back to ``all_gather_object``
(every rank sees every slot, so they all take the same path).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SLOT_BYTES", "all_gather_small"]

SLOT_BYTES = 1024  # the room for one rank's pickled value
_LENGTH_BYTES = 8
_TOO_BIG = 2**63  # the length a rank sends when its value does not fit


def _device(group: dist.ProcessGroup | None) -> torch.device | None:
    """Where the slots travel for this group's backend; None: let torch decide."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def all_gather_small(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order, as ``all_gather_object`` gives them; one
    collective when each rank's pickled value fits in ``SLOT_BYTES``. Call on every rank."""
    world = dist.get_world_size(group)
    device = _device(group)
    if device is None:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    length = len(data) if len(data) <= SLOT_BYTES else _TOO_BIG
    width = _LENGTH_BYTES + SLOT_BYTES
    buffer = bytearray(width)
    buffer[:_LENGTH_BYTES] = length.to_bytes(_LENGTH_BYTES, "little")
    if length != _TOO_BIG:
        buffer[_LENGTH_BYTES:_LENGTH_BYTES + length] = data
    slot = torch.frombuffer(buffer, dtype=torch.uint8)
    slots = [torch.empty_like(slot, device=device) for _ in range(world)]
    dist.all_gather(slots, slot.to(device), group=group)
    everyone = torch.stack(slots).cpu() if device.type != "cpu" else torch.stack(slots)
    raw = ctypes.string_at(everyone.data_ptr(), everyone.numel())
    rows = [raw[r * width:(r + 1) * width] for r in range(world)]
    lengths = [int.from_bytes(row[:_LENGTH_BYTES], "little") for row in rows]
    if any(n == _TOO_BIG for n in lengths):  # every rank sees it: all fall back together
        out = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out
    return [pickle.loads(row[_LENGTH_BYTES:_LENGTH_BYTES + n]) for row, n in zip(rows, lengths,
                                                                                strict=True)]
