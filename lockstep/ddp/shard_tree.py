"""The fixed summation tree of virtual shards: the same additions in the same order at any world.

``V`` virtual shards (a power of two) are the leaves of one balanced binary tree. A world of
``N`` ranks (``N`` divides ``V``) gives rank ``r`` the ``V/N`` consecutive leaves
``r*V/N .. (r+1)*V/N - 1``: an aligned block, hence a whole subtree. Each rank sums its block
with :class:`TreeSum` (the subtree), then :func:`combine_subtrees` adds the ``N`` subtree sums
with the top ``log2 N`` levels of the same tree. Every element of the result is therefore the
same expression of the same leaf values whatever ``N`` is, so it is bitwise the same: float
addition is not associative, but it is deterministic element by element.

The cross-rank step moves the bytes of a ring all-reduce: each rank owns one ``1/N`` slice of the
flat gradient, receives every rank's partial of it (``all_to_all_single``), sums them in tree
order, and ``all_gather`` returns the summed slices to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.virtual_world import check_virtual_shards, is_power_of_two

# check_virtual_shards is re-exported: its home is torch-free, for the launcher.
__all__ = ["TreeSum", "check_virtual_shards", "combine_subtrees", "tree_sum"]


def tree_sum(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum a power-of-two number of tensors as a balanced binary tree (left half + right half)."""
    if not is_power_of_two(len(leaves)):
        raise ValueError(f"tree_sum needs a power of two of tensors, got {len(leaves)}")
    level = list(leaves)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


class TreeSum:
    """Add leaves one at a time in the balanced-tree order, keeping ``log2`` partial sums.

    Pushing leaves ``a, b, c, d`` computes ``(a + b) + (c + d)``, exactly as :func:`tree_sum`.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (height, partial sum), left to right
        self.count = 0

    def push(self, leaf: torch.Tensor) -> None:
        height, value = 0, leaf
        while self._stack and self._stack[-1][0] == height:
            _, left = self._stack.pop()
            height, value = height + 1, left + value
        self._stack.append((height, value))
        self.count += 1

    def result(self) -> torch.Tensor:
        """The sum; ``ValueError`` unless a power of two of leaves was pushed."""
        if len(self._stack) != 1:
            raise ValueError(f"TreeSum needs a power of two of leaves, got {self.count}")
        return self._stack[0][1]


def combine_subtrees(local: torch.Tensor, world_size: int, group: Any = None) -> torch.Tensor:
    """Sum every rank's 1-D subtree sum in rank (= shard) order; the result on every rank.

    Each rank sends ``(N-1)/N`` of the tensor and receives as much, twice (all-to-all, then
    all-gather): the bytes of a ring all-reduce.
    """
    if world_size == 1:
        return local
    n = local.numel()
    chunk = -(-n // world_size)
    send = local.new_zeros(chunk * world_size)
    send[:n] = local
    received = torch.empty_like(send)
    progress = group_progress(group)
    hang.run(progress, "VirtualShardDDP gradient exchange (all-to-all)",
             lambda: dist.all_to_all_single(received, send, group=group))
    mine = tree_sum(list(received.view(world_size, chunk).unbind(0)))
    out = torch.empty_like(send)
    hang.run(progress, "VirtualShardDDP gradient all-gather",
             lambda: dist.all_gather(list(out.view(world_size, chunk).unbind(0)), mine, group=group))
    return out[:n]
