"""Tests of ZeRO's partition of parameters over ranks: pure logic, no processes."""

from __future__ import annotations

import itertools
import random

import pytest

from lockstep.zero.partition import assign_owners, partition_groups


def test_largest_first_onto_least_loaded():
    # 4 -> r0; 3 -> r1; 2 -> r1 (3 < 4); 1 -> r0 (4 < 5): loads 5 and 5.
    assert assign_owners([4, 1, 3, 2], world_size=2) == [0, 0, 1, 1]


def test_deterministic_ties_by_position_then_rank():
    assert assign_owners([2, 2, 2, 2], world_size=3) == [0, 1, 2, 0]


def test_every_item_has_exactly_one_valid_owner():
    rng = random.Random(0)
    sizes = [rng.randint(1, 1000) for _ in range(57)]
    for world in (1, 2, 3, 7):
        owners = assign_owners(sizes, world)
        assert len(owners) == len(sizes)
        assert set(owners) <= set(range(world))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_heaviest_rank_within_one_item_of_the_mean(world):
    rng = random.Random(world)
    sizes = [rng.randint(1, 10_000) for _ in range(200)]
    loads = [0] * world
    assign_owners(sizes, world, loads)
    assert sum(loads) == sum(sizes)
    # The LPT bound: the heaviest rank exceeds the mean by at most one item.
    assert max(loads) <= sum(sizes) / world + max(sizes)


def test_optimal_on_a_small_exhaustive_case():
    sizes = [7, 5, 4, 3, 3, 2]
    best = min(
        max(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2))
        for owners in itertools.product(range(2), repeat=len(sizes))
    )
    loads = [0, 0]
    assign_owners(sizes, 2, loads)
    assert max(loads) == best == 12


def test_more_ranks_than_items_leaves_some_ranks_empty():
    loads = [0, 0, 0]
    assert assign_owners([10], 3, loads) == [0]
    assert loads == [10, 0, 0]


def test_groups_balanced_together_and_appending_keeps_earlier_owners():
    first, loads = partition_groups([[8, 4], [6]], world_size=2)
    assert first == [[0, 1], [1]]
    assert loads == [8, 10]
    grown, _ = partition_groups([[8, 4], [6], [5, 5]], world_size=2)
    assert grown[:2] == first
    assert grown[2] == [0, 1]


def test_loads_argument_is_updated_in_place():
    loads = [100, 0]
    assert assign_owners([3, 3], 2, loads) == [1, 1]
    assert loads == [100, 6]


@pytest.mark.parametrize(
    ("sizes", "world", "loads", "message"),
    [
        ([1], 0, None, "world_size must be at least 1, got 0"),
        ([1, -2], 2, None, "size of item 1 is negative"),
        ([1], 2, [0, 0, 0], "loads has 3 entries, expected world_size=2"),
    ],
)
def test_errors_name_the_culprit(sizes, world, loads, message):
    with pytest.raises(ValueError, match=message):
        assign_owners(sizes, world, loads)
