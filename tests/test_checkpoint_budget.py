"""``Checkpointer(max_overhead=...)``: saves paced to a share of the loop's time (budget.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint import Checkpointer, load_file
from lockstep.checkpoint.budget import SaveBudget, check_share


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _saved(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in directory.glob("step_*"))


@pytest.mark.parametrize("share", [0.05, 1, 0.5])
def test_a_share_in_the_open_unit_interval_is_accepted(share):
    assert check_share(share) == share


@pytest.mark.parametrize("share, error", [
    (0, ValueError), (-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
    ("5%", TypeError), (True, TypeError), (None, TypeError),
])
def test_a_share_outside_it_is_refused_naming_max_overhead(share, error):
    with pytest.raises(error, match="max_overhead"):
        check_share(share)


def test_the_pace_is_the_expected_cost_over_the_share_in_steps():
    clock = _Clock()
    budget = SaveBudget(0.05, clock)
    assert not budget.passes_over(1)  # the first call always meets
    assert budget.propose(1) == 2  # no pace measured yet: meet again at the next step
    budget.agree([2])
    token = object()
    budget.taken(token, 0.01)  # the training thread's part; the writer's is not known yet
    assert not budget.passes_over(2)
    clock.now += 0.1  # one step of 0.1 s
    # Until its writer ends, the newest save's own part stands for its cost: 0.01 / 0.05 = 0.2 s.
    assert budget.propose(2) == 4
    budget.agree([4])
    assert budget.passes_over(3) and not budget.passes_over(4) and not budget.passes_over(5)
    budget.written(object(), 5.0)  # another save's writer: ignored
    assert budget.cost() == pytest.approx(0.01)
    budget.written(token, 0.04)
    budget.written(token, 0.04)  # counted once
    assert budget.cost() == pytest.approx(0.05) and budget.interval() == pytest.approx(1.0)
    clock.now += 0.2  # two steps of 0.1 s since the last meeting
    assert budget.propose(4) == 14  # 1 s of interval is 10 steps


def test_the_cost_is_the_median_of_the_last_saves_and_the_latest_proposal_holds():
    clock = _Clock()
    budget = SaveBudget(0.5, clock)
    for seconds in (0.01, 0.01, 2.0, 0.01, 0.01):  # one slow save does not set the pace
        token = object()
        budget.taken(token, 0.0)
        budget.written(token, seconds)
    assert budget.cost() == pytest.approx(0.01)
    budget.propose(10)
    budget.agree([12, 30, 11])  # every rank's proposal: the furthest holds on every rank
    assert budget.next_step == 30 and budget.passes_over(29)


def test_steps_that_go_back_meet_again():
    clock = _Clock()
    budget = SaveBudget(0.01, clock)
    budget.propose(10)
    budget.agree([1000])
    assert budget.passes_over(11)
    assert not budget.passes_over(10) and not budget.passes_over(3)  # e.g. a step count reset
    clock.now += 1.0
    assert budget.propose(3) == 4  # no pace from steps going back


def test_checkpointer_refuses_a_bad_max_overhead(tmp_path):
    with pytest.raises(ValueError, match="max_overhead"):
        Checkpointer(tmp_path, max_overhead=0)
    with pytest.raises(TypeError, match="max_overhead"):
        Checkpointer(tmp_path, max_overhead="5%")
    with pytest.raises(ValueError, match="blocking=True"):
        Checkpointer(tmp_path, blocking=True, max_overhead=0.05)
    assert Checkpointer(tmp_path, max_overhead=0.05).max_overhead == 0.05
    assert Checkpointer(tmp_path).max_overhead is None


def test_calls_too_soon_are_skipped_and_a_blocking_save_never_is(tmp_path):
    model = _model()
    ckpt = Checkpointer(tmp_path, keep=100, max_overhead=0.001)
    skipped = []
    for step in range(1, 21):  # each call right after the last: a save costs 1000x its time
        ckpt.save(step, model=model)
        skipped.append(ckpt.last_skipped)
    assert skipped[0] is False and all(skipped[2:])  # the first call saves, then the pace holds
    ckpt.save(21, model=model, blocking=True)
    assert ckpt.last_skipped is False
    ckpt.close()
    saved = _saved(tmp_path)
    assert saved == [s for s, skip in enumerate(skipped, 1) if not skip] + [21]
    restored = _model(1)
    assert Checkpointer(tmp_path).restore(model=restored).step == 21
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in restored.state_dict().items())


def _paced_on_two_ranks(rank: int, directory: str) -> list[bool]:
    lockstep.init_distributed()
    model = _model()
    ckpt = Checkpointer(directory, keep=100, max_overhead=0.01)
    skipped = []
    for step in range(1, 31):
        with torch.no_grad():
            model[0].bias.add_(1.0)  # a step that changes the state
        time.sleep(0.005 * (rank + 1))  # the ranks' paces differ; they must still agree
        ckpt.save(step, model=model)
        skipped.append(ckpt.last_skipped)
    ckpt.save(31, model=model, blocking=True)
    ckpt.close()
    return skipped


@pytest.mark.multirank
def test_every_rank_skips_the_same_calls_and_the_saves_restore(tmp_path):
    per_rank = lockstep.spawn(_paced_on_two_ranks, 2, (str(tmp_path),), timeout=120)
    assert per_rank[0] == per_rank[1]
    skipped = per_rank[0]
    assert not skipped[0] and sum(skipped) >= 15  # 1% of the time: most calls are skipped
    assert _saved(tmp_path) == [s for s, skip in enumerate(skipped, 1) if not skip] + [31]
    bias = _model()[0].bias.detach().clone()
    biases = []
    for _ in range(30):  # the bias after each step, added to as the ranks did
        bias += 1.0
        biases.append(bias.clone())
    for step in _saved(tmp_path):  # each holds the state of its own step
        state = load_file(tmp_path / f"step_{step:012d}" / "state.pt")
        assert torch.equal(state["objects"]["model"]["0.bias"], biases[min(step, 30) - 1])
    model = _model(1)
    assert Checkpointer(tmp_path).restore(model=model).step == 31
    assert torch.equal(model[0].bias, biases[-1])


def test_a_new_world_meets_at_its_first_call():
    """After lockstep.Survivors changes the world a joining rank knows no agreed step: forget()
    makes every rank meet at the next call (tests/test_survivors.py runs it with a kill)."""
    clock = _Clock()
    budget = SaveBudget(0.01, clock)
    token = object()
    budget.taken(token, 0.01)
    budget.written(token, 0.0)
    budget.propose(10)
    budget.agree([1000])
    assert budget.passes_over(11)
    budget.forget()
    assert not budget.passes_over(11) and budget.cost() == pytest.approx(0.01)
    assert budget.propose(11) == 12  # the pace is measured afresh
