"""Which rank owns which parameter: a deterministic, size-balanced greedy partition.

Pure logic, no communication: every rank computes the same answer from the same sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_owners", "partition_groups"]


def assign_owners(
    sizes: Sequence[int], world_size: int, loads: list[int] | None = None
) -> list[int]:
    """Owner rank of each item: largest first onto the least-loaded rank.

    Ties are broken by position (the earlier item first) and by rank (the lower rank first),
    so the result depends only on ``sizes`` and ``world_size``. Largest-first keeps the
    heaviest shard within one item of the mean (the LPT rule for makespan scheduling).

    Args:
        sizes: the size of each item (bytes, or elements), in order.
        world_size: the number of ranks to spread them over.
        loads: each rank's load before these items; updated in place when given, so
            partitions of several groups stay balanced together.

    Returns:
        ``owners`` with ``owners[i]`` the rank that holds item ``i``.

    Raises:
        ValueError: ``world_size`` below 1, a negative size, or ``loads`` of the wrong length.

    Example::

        >>> assign_owners([4, 1, 3, 2], world_size=2)
        [0, 0, 1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if loads is None:
        loads = [0] * world_size
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries, expected world_size={world_size}")
    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"size of item {index} is negative ({size})")
    owners = [0] * len(sizes)
    # sorted() is stable, so equal sizes keep their order: the result is deterministic.
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: loads[r])
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def partition_groups(
    group_sizes: Sequence[Sequence[int]], world_size: int
) -> tuple[list[list[int]], list[int]]:
    """Owners for several parameter groups, balanced over all of them.

    Groups are partitioned one after the other with the loads carried over, so appending a
    group later (``add_param_group``) never moves a parameter of an earlier group.

    Returns:
        ``(owners, loads)``: ``owners[g][i]`` owns parameter ``i`` of group ``g``; ``loads[r]``
        is the total size rank ``r`` holds.
    """
    loads = [0] * world_size
    owners = [assign_owners(sizes, world_size, loads) for sizes in group_sizes]
    return owners, loads
