"""accumulate(): only the last micro-step communicates; the result equals the whole batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.comm import CommState, uncompressed_hook

MICRO, PER_MICRO, STEPS = 4, 3, 2


class _Recorder(torch.nn.Module):
    """Stands in for DDP: records whether sync was on when each micro-batch was handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.sync = True

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


# ---- pure logic ---------------------------------------------------------------------------
def test_only_the_last_micro_batch_synchronises():
    model = _Recorder()
    seen = [(item, model.sync) for item in lockstep.accumulate(model, iter("abc"))]
    assert seen == [("a", False), ("b", False), ("c", True)]
    assert model.sync


def test_breaking_out_restores_sync():
    model = _Recorder()
    for _ in lockstep.accumulate(model, range(5)):
        break
    assert model.sync


def test_plain_module_and_empty_input():
    assert list(lockstep.accumulate(torch.nn.Linear(2, 2), [1, 2])) == [1, 2]
    assert list(lockstep.accumulate(_Recorder(), [])) == []


# ---- multi-rank ---------------------------------------------------------------------------
def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))


def _global_batch(step: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(world * MICRO * PER_MICRO, 5, generator=gen)


def _worker(rank: int) -> dict:
    lockstep.init_distributed()
    world = dist.get_world_size()
    reference, model = _net(), lockstep.DistributedDataParallel(_net())
    state = CommState()
    model.register_comm_hook(state, uncompressed_hook)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    worst_grad, syncs = 0.0, []
    for step in range(STEPS):
        batch = _global_batch(step, world)
        reference(batch).square().mean().backward()
        mine = batch.chunk(world)[rank]
        before = state.counter.steps
        for micro in lockstep.accumulate(model, mine.chunk(MICRO)):
            (model(micro).square().mean() / MICRO).backward()
        syncs.append(state.counter.steps - before)
        worst_grad = max(
            worst_grad,
            *((p.grad - q.grad).abs().max().item()
              for p, q in zip(model.parameters(), reference.parameters())),
        )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    worst_param = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )
    return {"grad": worst_grad, "param": worst_param, "syncs": syncs}


@pytest.mark.multirank
def test_accumulation_equals_whole_batch_at_world_2():
    for out in lockstep.spawn(_worker, 2, timeout=120):
        assert out["syncs"] == [1] * STEPS, "each optimizer step should all-reduce exactly once"
        assert out["grad"] < 1e-6 and out["param"] < 1e-6, out
