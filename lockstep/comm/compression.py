"""Gradient compression by a narrower dtype: fp16 and bf16 halve the bytes of every all-reduce.

Each hook divides by the world size *before* casting and summing, so the sum of N gradients
stays in range for fp16 (max 65504) whenever the mean does. fp16 keeps 11 significant bits in a
narrow range; bf16 keeps only 8 bits but fp32's range, so it never overflows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm.state import resolve_state
from lockstep.ddp.comm_hooks import GradBucket

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "compress_hook"]


def compress_hook(
    state: Any, bucket: GradBucket, dtype: torch.dtype | None
) -> "torch.futures.Future[torch.Tensor]":
    """All-reduce the bucket's mean in ``dtype`` (``None``: its own dtype), then cast back.

    Args:
        state: a :class:`~lockstep.comm.CommState`, a process group, or ``None``.
        bucket: the gradients to reduce.
        dtype: the dtype sent over the wire.

    Returns:
        A future holding the averaged bucket buffer, in the buffer's own dtype.
    """
    group, counter = resolve_state(state)
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    wire = buffer.div(world) if dtype in (None, buffer.dtype) else buffer.div(world).to(dtype)
    if counter is not None:
        counter.record(wire)
        if bucket.is_last():
            counter.end_step()
    work = dist.all_reduce(wire, group=group, async_op=True)

    def decompress(fut: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def allreduce_hook(state: Any, bucket: GradBucket) -> "torch.futures.Future[torch.Tensor]":
    """The uncompressed mean, counted: the baseline the other hooks are measured against.

    Example::

        state = lockstep.comm.CommState()
        ddp.register_comm_hook(state, lockstep.comm.allreduce_hook)
    """
    return compress_hook(state, bucket, None)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> "torch.futures.Future[torch.Tensor]":
    """All-reduce the gradients as float16: half the bytes of float32, 11 significant bits.

    Example::

        ddp.register_comm_hook(lockstep.comm.CommState(), lockstep.fp16_compress_hook)
    """
    return compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> "torch.futures.Future[torch.Tensor]":
    """All-reduce the gradients as bfloat16: half the bytes of float32, float32's range.

    Example::

        ddp.register_comm_hook(lockstep.comm.CommState(), lockstep.bf16_compress_hook)
    """
    return compress_hook(state, bucket, torch.bfloat16)
