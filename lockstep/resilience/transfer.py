"""Bring every member of a new generation to one member's state, over the process group.

The state (model, optimizer, the loop's step and what the caller adds) travels as the bytes of
``torch.save``, so tensors arrive bit for bit, whatever the optimizer keeps; a replacement that
has not stepped yet (an empty Adam state) loads it like any other member.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast_state"]


def _pack(state: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def broadcast_state(state: Any, src: int, device: torch.device) -> Any:
    """``state`` of group rank ``src`` on every rank of the default group (CPU tensors).

    ``device``: where the backend wants its tensors (CUDA for NCCL), the payload is copied
    there and back.
    """
    rank = dist.get_rank()
    payload = _pack(state) if rank == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    wire = payload.to(device) if rank == src else torch.empty(int(size.item()), dtype=torch.uint8,
                                                              device=device)
    dist.broadcast(wire, src)
    if rank == src:
        return state
    return torch.load(io.BytesIO(wire.cpu().numpy().tobytes()), weights_only=True,
                      map_location="cpu")
