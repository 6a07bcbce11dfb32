"""Sharing updated parameters: each owner broadcasts its shard, one flat tensor per dtype.

Coalescing matters: one collective per tensor costs a latency each (hundreds of small
broadcasts for a transformer), one per owner and dtype costs ``world_size`` latencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.distributed import global_ranks

__all__ = ["OwnerBucket", "attach_views", "broadcast_buckets", "global_ranks", "make_buckets"]


@dataclass
class OwnerBucket:
    """The parameters of one owner rank and one dtype, flattened back to back in this order.

    ``buffer`` is set only in bucket-view mode, where the parameters are views into it.
    """

    owner: int
    dtype: torch.dtype
    params: list[torch.Tensor]
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def make_buckets(params_by_owner: Sequence[Sequence[torch.Tensor]]) -> list[OwnerBucket]:
    """Group each owner's parameters by dtype, in order; owners without any are left out."""
    buckets: list[OwnerBucket] = []
    for owner, params in enumerate(params_by_owner):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        buckets.extend(OwnerBucket(owner, dtype, ps) for dtype, ps in by_dtype.items())
    return buckets


def attach_views(bucket: OwnerBucket) -> None:
    """Move the bucket's parameters into one flat buffer and make each a view of it.

    After this, broadcasting ``bucket.buffer`` updates the parameters with no copy. Views made
    of the parameters before this call no longer alias them (as with torch's own bucket view).
    """
    first = bucket.params[0]
    buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=first.device)
    offset = 0
    with torch.no_grad():
        for p in bucket.params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()
    bucket.buffer = buffer


@torch.no_grad()
def broadcast_buckets(
    buckets: Sequence[OwnerBucket], rank: int, group: dist.ProcessGroup | None, ranks: list[int]
) -> None:
    """Overwrite every rank's copy of each bucket's parameters with the owner's.

    Args:
        buckets: the buckets, in the same order on every rank.
        rank: this process's rank in ``group``.
        group: the process group (``None``: the default group).
        ranks: global rank of each group rank, from :func:`global_ranks`.
    """
    progress = group_progress(group)  # names a rank that never arrives
    pending = []
    for bucket in buckets:
        if bucket.buffer is not None:
            # Bucket view: the parameters live in the buffer, so all broadcasts can be in flight.
            src = ranks[bucket.owner]
            seq = progress.enter(f"ZeRO parameter broadcast from rank {src}")
            pending.append((seq, src, dist.broadcast(bucket.buffer, src=src, group=group,
                                                     async_op=True)))
            continue
        if bucket.owner == rank:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
        # One bucket at a time: the staging copy then never exceeds the largest shard.
        src = ranks[bucket.owner]
        hang.run(progress, f"ZeRO parameter broadcast from rank {src}",
                 partial(dist.broadcast, flat, src=src, group=group))
        if bucket.owner != rank:
            _unflatten_into(flat, bucket.params)
    for seq, src, work in pending:
        hang.wait(progress, seq, f"ZeRO parameter broadcast from rank {src}", work)


def _unflatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.detach().copy_(chunk.view_as(p))
