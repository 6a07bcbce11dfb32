"""Gradients sent in bf16 (or fp16), their mean accumulated in fp32: half the bytes, no drift.

A bf16 all-reduce also *sums* in bf16: a ring adds the ranks' contributions one by one, rounding
every partial sum to 8 significant bits. The partial sums grow with the number of ranks while
each contribution stays the same size, so the later ones lose ever more of their bits, and at
hundreds of ranks the error of the mean is many times that of one rounding (issue #16;
``tests/test_fp32_accumulate.py`` simulates 64 ranks). This module keeps bf16 on the wire
but adds in fp32, by doing the all-reduce's two halves itself (a ring all-reduce *is* a
reduce-scatter followed by an all-gather):

1. every rank casts its bucket to the wire dtype and splits it into ``world`` chunks;
   ``all_to_all_single`` hands chunk ``r`` of every rank to rank ``r`` (a reduce-scatter
   without the reduction, which gloo and NCCL cannot do in fp32 on bf16 inputs);
2. rank ``r`` adds its ``world`` copies of chunk ``r`` in fp32 and divides by ``world``
   (:func:`fp32_accumulated_mean`, the same function the tests check at 64 simulated ranks);
3. ``all_gather`` sends every rank every chunk's mean, in the wire dtype, and each rank
   copies the result into its fp32 gradient buffer.

The mean is gathered in the wire dtype, not in fp32, for two reasons: the bytes then equal a
bf16 ring all-reduce's (each half moves ``(world - 1) / world`` of the bucket, as each half of
the ring does), where fp32 would send 1.5 times as much; and its error is one rounding of the
mean, which no longer grows with the number of ranks. Every rank, the chunk's owner included,
copies the *gathered* value, so the replicas stay bitwise equal.

:func:`lockstep.comm.reduce_dtype_hook` (DDP's ``mixed_precision=``) is the other behaviour on
purpose: it sums in ``reduce_dtype`` exactly as torch's DDP does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lockstep.comm.state import ByteCounter, CommState, resolve_state

if TYPE_CHECKING:
    from lockstep.comm.hooks import GradBucket

__all__ = [
    "FP32AccumulateState",
    "bf16_fp32_accumulate_hook",
    "check_wire_dtype",
    "fp32_accumulate_hook",
    "fp32_accumulated_mean",
]


def check_wire_dtype(dtype: Any, what: str) -> torch.dtype:
    """``dtype`` if it is a floating-point ``torch.dtype``; ``what`` names the argument.

    Raises:
        TypeError: anything else (an integer dtype, a string such as ``"bf16"``, ...).
    """
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise TypeError(
        f"{what} must be a floating-point torch.dtype such as torch.bfloat16 (the dtype "
        f"gradients travel in), got {dtype!r}"
    )


@dataclass
class FP32AccumulateState(CommState):
    """State of :func:`fp32_accumulate_hook`: a :class:`~lockstep.comm.CommState` and the wire dtype.

    Args:
        wire_dtype: the dtype gradients and their mean travel in (bf16 by default).

    Raises:
        TypeError: ``wire_dtype`` is not a floating-point dtype.

    Example::

        state = lockstep.comm.FP32AccumulateState(wire_dtype=torch.float16)
        ddp.register_comm_hook(state, lockstep.comm.fp32_accumulate_hook)
    """

    wire_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        check_wire_dtype(self.wire_dtype, "FP32AccumulateState: wire_dtype")


def fp32_accumulated_mean(contributions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The mean over dimension 0 of ``contributions`` (one row per rank), added up in ``dtype``.

    This is the arithmetic of :func:`fp32_accumulate_hook` on one chunk: the rows arrive in
    the wire dtype and are summed and divided in ``dtype`` (at least float32), never rounded
    to the wire dtype on the way.

    Args:
        contributions: ``(ranks, n)`` tensor, e.g. bf16 gradients from each rank.
        dtype: the accumulation dtype (float32; float64 for float64 gradients).

    Returns:
        The ``n`` means, in ``dtype``.

    Example::

        rows = torch.randn(64, 10).bfloat16()
        mean = fp32_accumulated_mean(rows)          # float32
    """
    total = contributions.to(dtype).sum(dim=0)
    return total.div_(contributions.shape[0])


def fp32_accumulate_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean: sent in the state's ``wire_dtype`` (bf16), accumulated in fp32.

    See the module docstring for the three steps. The all-to-all is waited for inside the hook
    (its result is needed before the all-gather can start); the all-gather overlaps the rest of
    backward as a plain all-reduce would. The bytes counted are the bucket in the wire dtype,
    as for :func:`~lockstep.comm.bf16_compress_hook`: the all-to-all and the all-gather
    together move what one ring all-reduce of it moves.

    A sparse gradient (``nn.Embedding(sparse=True)``) is averaged uncompressed, as DDP's
    default hook does, and not counted.

    Args:
        state: a :class:`FP32AccumulateState`; a :class:`~lockstep.comm.CommState`, a process
            group or ``None`` send bf16.
        bucket: the gradients to reduce.

    Returns:
        A future holding the bucket buffer (its own dtype, e.g. fp32), now the mean over ranks.
    """
    group, counter = resolve_state(state)
    return _reduce(bucket, group, counter, getattr(state, "wire_dtype", torch.bfloat16))


def bf16_fp32_accumulate_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradients sent in bf16, their mean accumulated in fp32: the recommended bf16 reduction.

    The same bytes as :func:`~lockstep.comm.bf16_compress_hook`, without its error growing
    with the number of ranks. ``DistributedDataParallel(model, reduce_dtype=torch.bfloat16)``
    installs it.

    Example::

        ddp.register_comm_hook(lockstep.comm.CommState(), lockstep.comm.bf16_fp32_accumulate_hook)
    """
    group, counter = resolve_state(state)
    return _reduce(bucket, group, counter, torch.bfloat16)


def _reduce(
    bucket: GradBucket, group: dist.ProcessGroup, counter: ByteCounter | None, wire_dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if buffer.is_sparse:  # a sparse embedding's bucket: its rows differ by rank, nothing to split
        from lockstep.comm.hooks import allreduce_hook

        return allreduce_hook(group, bucket)
    world = dist.get_world_size(group)
    n = buffer.numel()
    chunk = -(-n // world)  # ceil: the last chunk is padded with zeros
    send = buffer.new_zeros(world * chunk, dtype=wire_dtype)
    # float16 holds at most 65504: each rank's share (divided by the world size) is sent and
    # the shares summed, as fp16_compress_hook divides before it casts, so a mean that fits
    # is not lost to an overflowing addend. bfloat16 has float32's range: sent as it is.
    prescale = wire_dtype == torch.float16
    send[:n].copy_(buffer / world if prescale else buffer)
    if counter is not None:
        counter.record(send[:n])  # (the < world padding elements are not counted)
        if bucket.is_last():
            counter.end_step()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group, async_op=True).wait()
    accumulate = torch.promote_types(buffer.dtype, torch.float32)
    rows = received.view(world, chunk)
    mean = rows.to(accumulate).sum(dim=0) if prescale else fp32_accumulated_mean(rows, accumulate)
    mine = mean.to(wire_dtype)
    gathered = torch.empty_like(send)
    work = _all_gather_flat(gathered, mine, group)

    def unpack(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(gathered[:n])
        return buffer

    return work.get_future().then(unpack)


def _all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup) -> Any:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=True)
