"""A DataLoader with worker processes reads a sampler ahead of the loop: the samplers' state
counts what the loop received, so a checkpoint mid-epoch resumes after the last batch trained
on and no sample read ahead is skipped."""

import gc
import weakref

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import lockstep
from lockstep.virtual_sampler import VirtualShardSampler

DATASET = TensorDataset(torch.arange(96))


def _sampler(**kwargs):
    return lockstep.DistributedSampler(DATASET, num_replicas=2, rank=0, seed=3, **kwargs)


def _rest_after(state, **kwargs):
    resumed = _sampler(**kwargs)
    resumed.load_state_dict(state)
    return list(resumed)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_counts_the_batches_the_loop_received(workers):
    sampler = _sampler()
    whole = list(_sampler())
    it = iter(DataLoader(DATASET, batch_size=4, sampler=sampler, num_workers=workers,
                         prefetch_factor=2 if workers else None))
    seen = [int(i) for _ in range(3) for i in next(it)[0]]
    state = sampler.state_dict()
    # Two workers hold up to four batches read ahead: counting them would skip 16 samples.
    assert state["consumed"] == 3 * 4 * 2
    assert seen + _rest_after(state) == whole
    del it


def test_a_loop_left_with_break_keeps_its_count_and_lets_the_workers_go():
    sampler = _sampler()
    loader = DataLoader(DATASET, batch_size=4, sampler=sampler, num_workers=2)
    it = iter(loader)
    alive = weakref.ref(it)
    workers = list(it._workers)
    for step, _ in enumerate(it):
        if step == 4:
            break
    del it
    gc.collect()
    assert alive() is None, "the sampler's count must not keep the DataLoader iterator alive"
    for worker in workers:
        worker.join(timeout=30)
        assert not worker.is_alive()
    assert sampler.state_dict()["consumed"] == 5 * 4 * 2


def test_a_finished_pass_with_drop_last_is_complete():
    sampler = _sampler()
    for _ in DataLoader(DATASET, batch_size=5, sampler=sampler, drop_last=True, num_workers=2):
        pass
    assert sampler.state_dict()["consumed"] == len(DATASET)


def test_explicit_count_and_a_plain_read_are_as_before():
    sampler = _sampler()
    it = iter(DataLoader(DATASET, batch_size=4, sampler=sampler, num_workers=2))
    next(it)
    assert sampler.state_dict(samples_per_rank=2)["consumed"] == 4
    plain = _sampler()
    reader = iter(plain)
    for _ in range(7):
        next(reader)
    assert plain.state_dict()["consumed"] == 14
    del it


def test_an_unknown_batch_sampler_falls_back_to_what_was_yielded():
    class Pairs(BatchSampler):  # torch's BatchSampler over another sampler than ours
        pass

    sampler = _sampler()
    inner = BatchSampler(sampler, batch_size=2, drop_last=False)
    outer = Pairs(inner, batch_size=2, drop_last=False)
    it = iter(DataLoader(DATASET, batch_sampler=outer, num_workers=0,
                         collate_fn=lambda batch: batch))
    next(it)
    assert sampler.state_dict()["consumed"] == 4 * 2  # two pairs of two: what was yielded
    del it


def test_virtual_shard_sampler_counts_the_steps_the_loop_received():
    sampler = VirtualShardSampler(DATASET, 4, 2, num_replicas=2, rank=0, seed=1)
    it = iter(DataLoader(DATASET, batch_sampler=sampler, num_workers=2))
    for _ in range(2):
        next(it)
    assert sampler.state_dict()["steps"] == 2
    del it
