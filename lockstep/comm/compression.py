"""Gradient compression by a narrower dtype: fp16 and bf16 halve the bytes of every all-reduce.

Each compression hook divides by the world size *before* casting and summing, so the sum of N
gradients stays in range for fp16 (max 65504) whenever the mean does. fp16 keeps 11 significant
bits in a narrow range; bf16 keeps only 8 bits but fp32's range, so it never overflows.

:func:`reduce_dtype_hook` is different on purpose: it is DDP's ``mixed_precision=`` reduction
and does what torch's does (cast, sum, then divide), so results match torch's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lockstep.comm.state import CommState, resolve_state

if TYPE_CHECKING:
    from lockstep.comm.hooks import GradBucket

__all__ = [
    "ReduceDtypeState",
    "bf16_compress_hook",
    "compress_hook",
    "fp16_compress_hook",
    "reduce_dtype_hook",
    "uncompressed_hook",
]


def compress_hook(
    state: Any, bucket: GradBucket, dtype: torch.dtype | None
) -> torch.futures.Future[torch.Tensor]:
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

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def uncompressed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed mean, counted: the baseline the other hooks are measured against.

    (DDP's default, torch's ``allreduce_hook(process_group, bucket)``, is
    :func:`lockstep.ddp.allreduce_hook`; this one also fills the state's byte counter.)

    Example::

        state = lockstep.comm.CommState()
        ddp.register_comm_hook(state, lockstep.comm.uncompressed_hook)
    """
    return compress_hook(state, bucket, None)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the gradients as float16: half the bytes of float32, 11 significant bits.

    Example::

        ddp.register_comm_hook(lockstep.comm.CommState(), lockstep.fp16_compress_hook)
    """
    return compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the gradients as bfloat16: half the bytes of float32, float32's range.

    Example::

        ddp.register_comm_hook(lockstep.comm.CommState(), lockstep.bf16_compress_hook)
    """
    return compress_hook(state, bucket, torch.bfloat16)


@dataclass
class ReduceDtypeState(CommState):
    """State of :func:`reduce_dtype_hook`: a :class:`~lockstep.comm.CommState` and the wire dtype.

    Args:
        reduce_dtype: the dtype gradients are summed in (``None``: their own dtype).
    """

    reduce_dtype: torch.dtype | None = None


def reduce_dtype_hook(
    state: ReduceDtypeState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's ``mixed_precision=...(reduce_dtype=...)``: the mean computed in ``reduce_dtype``.

    As torch's DDP does: cast the bucket to ``reduce_dtype``, all-reduce the sum in that dtype,
    divide by the world size in that dtype, cast back into the bucket (the parameters' dtype).
    Summing before dividing is torch's order; it is what makes the two agree bit for bit.
    """
    group, counter = resolve_state(state)
    buffer = bucket.buffer()
    dtype = state.reduce_dtype or buffer.dtype
    wire = buffer.to(dtype, copy=True)
    if counter is not None:
        counter.record(wire)
        if bucket.is_last():
            counter.end_step()
    work = dist.all_reduce(wire, group=group, async_op=True)
    world = dist.get_world_size(group)

    def mean(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0].div_(world))
        return buffer

    return work.get_future().then(mean)
