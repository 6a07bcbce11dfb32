"""DistributedSampler: torch's arithmetic exactly, shards disjoint and covering, resume, errors."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.utils.data

import lockstep
from lockstep.sampler import DistributedSampler, shard_length


def _shards(n: int, world: int, **kwargs) -> list[list[int]]:
    return [list(DistributedSampler(range(n), world, r, **kwargs)) for r in range(world)]


# --- pure arithmetic, no processes -------------------------------------------------------------


def test_same_indices_as_torch_for_every_small_case():
    for n, world, drop_last, shuffle in itertools.product(
        range(1, 24), range(1, 5), (False, True), (False, True)
    ):
        if drop_last and n < world:
            continue
        for rank in range(world):
            ours = DistributedSampler(range(n), world, rank, shuffle, 7, drop_last)
            theirs = torch.utils.data.DistributedSampler(range(n), world, rank, shuffle, 7, drop_last)
            ours.set_epoch(3)
            theirs.set_epoch(3)
            assert list(ours) == list(theirs), (n, world, rank, shuffle, drop_last)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_are_equal_disjoint_and_cover_the_dataset(world):
    n = 10
    shards = _shards(n, world, shuffle=True, seed=1)
    assert len({len(s) for s in shards}) == 1
    assert set().union(*shards) == set(range(n))
    # Only the padding repeats indices, and at most (world - 1) of them.
    assert sum(map(len, shards)) - n == (-n) % world

    dropped = _shards(n, world, shuffle=True, seed=1, drop_last=True)
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == (n // world) * world
    assert len({len(s) for s in dropped}) == 1


def test_tiny_dataset_is_padded_to_every_rank():
    shards = _shards(2, 4, shuffle=False)
    assert shards == [[0], [1], [0], [1]]


def test_shuffle_changes_with_epoch_and_is_reproducible():
    sampler = DistributedSampler(range(50), 2, 0, seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    again = DistributedSampler(range(50), 2, 0, seed=5)
    again.set_epoch(1)
    assert list(again) == second
    assert list(DistributedSampler(range(6), 2, 1, shuffle=False)) == [1, 3, 5]


def test_shard_length():
    assert shard_length(10, 3, drop_last=False) == 4
    assert shard_length(10, 3, drop_last=True) == 3
    assert shard_length(0, 3, drop_last=False) == 0


def test_defaults_come_from_the_launcher_environment(monkeypatch):
    sampler = DistributedSampler(range(8))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    sampler = DistributedSampler(range(8), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    assert list(sampler) == [2, 6]


def test_numpy_integers_are_accepted_as_torch_accepts_them():
    import numpy as np

    ours = DistributedSampler(range(5), num_replicas=np.int64(2), rank=np.int64(1), seed=np.int32(0))
    theirs = torch.utils.data.DistributedSampler(range(5), num_replicas=np.int64(2), rank=np.int64(1))
    assert list(ours) == list(theirs) and type(ours.num_replicas) is int


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match=r"rank 3 is outside \[0, 3\)"):
        DistributedSampler(range(8), num_replicas=3, rank=3)
    with pytest.raises(ValueError, match=r"rank -1 is outside"):
        DistributedSampler(range(8), num_replicas=3, rank=-1)
    with pytest.raises(ValueError, match="num_replicas must be at least 1, got 0"):
        DistributedSampler(range(8), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="the dataset is empty"):
        DistributedSampler([], num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="3 samples, fewer than num_replicas=4.*drop_last=False"):
        DistributedSampler(range(3), num_replicas=4, rank=0, drop_last=True)


def test_warns_once_when_an_epoch_repeats_without_set_epoch():
    sampler = DistributedSampler(range(8), 2, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(sampler)
        list(sampler)
        list(sampler)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "same epoch" in messages[0] and "set_epoch(epoch)" in messages[0]

    for kwargs in ({"shuffle": True}, {"shuffle": False}):
        sampler = DistributedSampler(range(8), 2, 0, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for epoch in range(3):
                if kwargs["shuffle"]:
                    sampler.set_epoch(epoch)
                list(sampler)


def _tutorial_epochs(loader, sampler, epochs: int, call_set_epoch: bool) -> list[str]:
    """pytorch/examples multigpu_torchrun.py's Trainer._run_epoch shape; returns the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(epochs):
            b_sz = len(next(iter(loader))[0])
            assert b_sz == 4
            if call_set_epoch:
                sampler.set_epoch(epoch)
            for source, targets in loader:
                assert len(source) == len(targets)
    return [str(w.message) for w in caught if "DistributedSampler" in str(w.message)]


def test_tutorial_peek_before_set_epoch_is_silent_and_a_missing_set_epoch_still_warns():
    data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    for call_set_epoch, expected in ((True, 0), (False, 1)):
        sampler = DistributedSampler(data, 2, 1)
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False, sampler=sampler)
        messages = _tutorial_epochs(loader, sampler, 3, call_set_epoch)
        assert len(messages) == expected, (call_set_epoch, messages)
    # A loop that breaks after one batch and never calls set_epoch still warns.
    sampler = DistributedSampler(range(32), 2, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            next(iter(sampler))
    assert len(caught) == 1 and "set_epoch(epoch)" in str(caught[0].message)


# --- resuming mid-epoch ------------------------------------------------------------------------


def _consume(samplers: list[DistributedSampler], per_rank: int) -> list[int]:
    """Each rank takes ``per_rank`` indices of its pass; returns them all."""
    taken = []
    for sampler in samplers:
        iterator = iter(sampler)
        taken += [next(iterator) for _ in range(per_rank)]
    return taken


@pytest.mark.parametrize("old_world,new_world", [(2, 2), (3, 2), (2, 4)])
def test_resume_mid_epoch_even_on_another_world_size(old_world, new_world):
    n = 24
    old = [DistributedSampler(range(n), old_world, r, seed=3) for r in range(old_world)]
    for sampler in old:
        sampler.set_epoch(1)
    taken = _consume(old, per_rank=3)
    states = [s.state_dict() for s in old]
    assert all(state == states[0] for state in states)  # any rank may save it
    assert states[0] == {"epoch": 1, "consumed": 3 * old_world, "seed": 3, "num_replicas": old_world,
                         "pad_origin": 0, "dataset_size": n}

    new = [DistributedSampler(range(n), new_world, r, seed=3) for r in range(new_world)]
    rest = []
    for sampler in new:
        sampler.load_state_dict(states[0])
        sampler.set_epoch(1)  # the resumed epoch: keeps its place
        assert len(sampler) == shard_length(n - 3 * old_world, new_world, False)
        rest += list(sampler)
    # Nothing replayed, nothing skipped (up to the padding of the last step).
    assert set(taken).isdisjoint(rest)
    assert set(taken) | set(rest) == set(range(n))
    assert len(set(rest)) == n - len(taken)

    # The pass after the resumed one is a whole epoch again.
    for sampler in new:
        sampler.set_epoch(2)
    assert set().union(*(set(s) for s in new)) == set(range(n))


def test_a_resumed_pass_resumed_again_pads_as_it_did():
    # Saved at world 2, resumed at world 3, saved again mid-pass and resumed at world 3: the
    # second resume goes on exactly as the first resumed pass would have, and its padding
    # never repeats a sample consumed before the first resume.
    n = 24  # 16 left after the first save: padded to 18 at world 3
    old = [DistributedSampler(range(n), 2, r, seed=5) for r in range(2)]
    taken = _consume(old, per_rank=4)
    first = old[0].state_dict()

    def resumed(state):
        samplers = [DistributedSampler(range(n), 3, r, seed=5) for r in range(3)]
        for sampler in samplers:
            sampler.load_state_dict(state)
        return samplers

    uninterrupted = [list(s) for s in resumed(first)]
    again = resumed(first)
    middle = _consume(again, per_rank=2)
    second = again[0].state_dict()
    assert second["pad_origin"] == first["consumed"] == 8
    rest = [list(s) for s in resumed(second)]
    assert [u[2:] for u in uninterrupted] == rest
    assert set(taken).isdisjoint(middle + [i for shard in rest for i in shard])
    # The pass after it pads from the epoch's start again.
    nxt = resumed(second)
    for sampler in nxt:
        list(sampler)
        sampler.set_epoch(1)
    assert nxt[0].state_dict()["pad_origin"] == 0


def test_a_forged_pad_origin_is_refused():
    sampler = DistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match="pad_origin=7"):
        sampler.load_state_dict({"epoch": 0, "consumed": 4, "seed": 0, "num_replicas": 2, "pad_origin": 7})


def test_state_after_a_complete_pass_and_explicit_counts():
    sampler = DistributedSampler(range(10), 3, 1, drop_last=True)
    list(sampler)
    assert sampler.state_dict()["consumed"] == 10  # the dropped tail counts as consumed
    resumed = DistributedSampler(range(10), 3, 1, drop_last=True)
    resumed.load_state_dict(sampler.state_dict())
    assert len(resumed) == 0 and list(resumed) == []

    # A DataLoader with workers reads ahead: the loop passes the count it really used.
    ahead = DistributedSampler(range(20), 2, 0)
    iterator = iter(ahead)
    for _ in range(6):
        next(iterator)
    assert ahead.consumed() == 12
    assert ahead.state_dict(samples_per_rank=2)["consumed"] == 4
    ahead.set_epoch(1)
    assert ahead.state_dict() == {"epoch": 1, "consumed": 0, "seed": 0, "num_replicas": 2,
                                  "pad_origin": 0, "dataset_size": 20}


def test_resume_through_a_dataloader():
    dataset = list(range(30))
    sampler = DistributedSampler(dataset, 2, 0, seed=9)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    iterator = iter(loader)
    seen = [int(i) for _ in range(2) for i in next(iterator)]
    state = sampler.state_dict()
    assert state["consumed"] == 16
    full = list(DistributedSampler(dataset, 2, 0, seed=9))  # the uninterrupted pass
    resumed = DistributedSampler(dataset, 2, 0, seed=9)
    resumed.load_state_dict(state)
    rest = [int(i) for batch in torch.utils.data.DataLoader(dataset, 4, sampler=resumed) for i in batch]
    assert seen + rest == full


def test_load_state_dict_errors():
    sampler = DistributedSampler(range(10), 2, 0, seed=1)
    with pytest.raises(ValueError, match=r"lacks \['consumed'\]"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="seed=2, this sampler has seed=1"):
        sampler.load_state_dict({"epoch": 0, "consumed": 0, "seed": 2})
    with pytest.raises(ValueError, match="11 samples were consumed, but the dataset has 10"):
        sampler.load_state_dict({"epoch": 0, "consumed": 11})
    # A dataset that grew (more files): accepted silently, in another order, until 2026-11-29.
    bigger = DistributedSampler(range(20), 2, 0, seed=1)
    with pytest.raises(ValueError, match="saved for a dataset of 10 samples, this sampler's has 20"):
        bigger.load_state_dict(sampler.state_dict())


# --- several ranks -----------------------------------------------------------------------------


def _shard_in_world(rank: int, n: int) -> tuple[list[int], list[int]]:
    info = lockstep.init_distributed()
    sampler = lockstep.DistributedSampler(range(n), seed=4)  # world and rank from the group
    sampler.set_epoch(2)
    dropped = lockstep.DistributedSampler(range(n), seed=4, drop_last=True)
    assert (sampler.rank, sampler.num_replicas) == (info.rank, info.world_size)
    return list(sampler), list(dropped)


@pytest.mark.multirank
def test_shards_in_a_world_of_three():
    n = 11
    results = lockstep.spawn(_shard_in_world, 3, args=(n,), timeout=120)
    padded = [r[0] for r in results]
    dropped = [r[1] for r in results]
    assert {len(s) for s in padded} == {4}
    assert set().union(*padded) == set(range(n))
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == 9
    reference = [torch.utils.data.DistributedSampler(range(n), 3, r, seed=4) for r in range(3)]
    for r, sampler in enumerate(reference):
        sampler.set_epoch(2)
        assert padded[r] == list(sampler)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_resume_on_the_same_world_pads_as_the_uninterrupted_pass(world):
    """40 samples on 3 or 4 ranks need padding: a same-world resume yields exactly the rest of
    the uninterrupted pass, padding included (bitwise-equal training after a restart)."""
    full = [list(DistributedSampler(range(40), world, r, seed=5)) for r in range(world)]
    for done in range(len(full[0]) + 1):
        saver = DistributedSampler(range(40), world, 0, seed=5)
        it = iter(saver)
        for _ in range(done):
            next(it)
        state = saver.state_dict()
        for r in range(world):
            resumed = DistributedSampler(range(40), world, r, seed=5)
            resumed.load_state_dict(state)
            assert list(resumed) == full[r][done:]
