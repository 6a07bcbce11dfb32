"""lockstep.Survivors: a killed rank leaves the world, the others go on, a replacement joins;
the result is the run that was given the same schedule of worlds, bit for bit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep
from lockstep.resilience.roster import Member, Proposal, propose

SCRIPT = Path(__file__).parent / "scripts" / "survivors_train.py"


def _job():
    spec = importlib.util.spec_from_file_location("survivors_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay_phase(rank: int, slots: list[int], start: int, end: int, state_in: str | None,
                  state_out: str) -> None:
    """Steps ``start..end-1`` in a world of ``slots`` (rank r plays slot ``slots[r]``)."""
    job = _job()
    lockstep.init_distributed()
    net, model, optimizer = job.build()
    if state_in:
        state = torch.load(state_in, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in range(start, end):
        job.train_step(model, optimizer, step, slots[rank])
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "params": [p.detach().clone() for p in net.parameters()]}, state_out)


def test_proposal_takes_the_furthest_member_and_round_trips() -> None:
    alive = [Member(2, 22, 7), Member(0, 10, 8), Member(3, 33, 8)]
    proposal = propose(5, alive, [Member(1, 11)])
    assert proposal.slots == [0, 1, 2, 3]
    assert proposal.source == 0 and proposal.step == 8  # most steps; the first slot among equals
    assert [m.step for m in proposal.members] == [8, -1, 7, 8]  # the replacement has none
    assert proposal.rank_of(2) == 2
    assert Proposal.decode(proposal.encode()) == proposal
    with pytest.raises(ValueError, match="surviving member"):
        propose(1, [], [Member(0, 1)])
    with pytest.raises(ValueError, match="claim one slot"):
        propose(1, [Member(0, 1, 3)], [Member(0, 2)])


def test_without_survivors_mode_a_step_error_propagates() -> None:
    team = lockstep.Survivors()  # plain python: a world of one, failures are not caught
    try:
        assert (team.rank, team.world_size, team.members) == (0, 1, [0])
        with pytest.raises(ZeroDivisionError), team.step():
            _ = 1 / 0
        assert team.completed == 0
        with team.step():
            pass
        assert team.completed == 1
    finally:
        team.finish()


@pytest.mark.timeout(240)
def test_a_killed_rank_is_replaced_and_the_result_equals_the_same_schedule(tmp_path) -> None:
    out = tmp_path / "out.pt"
    steps = 24
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--survivors", "--max-restarts", "1",
         "--nproc-per-node", "3", str(SCRIPT), "--steps", str(steps), "--kill-slot", "1",
         "--kill-at", "6", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr
    result = torch.load(out, weights_only=False)
    history = result["history"]
    # Three worlds: all, the two survivors from the killed step on, all again once rejoined.
    assert [slots for _, slots in history] == [(0, 1, 2), (0, 2), (0, 1, 2)], history
    assert history[1][0] in (6, 7)  # the killed step runs again (or was finished by a peer)
    ends = [start for start, _ in history[1:]] + [steps]
    state = None
    for (start, slots), end in zip(history, ends):
        phase = str(tmp_path / f"phase{start}.pt")
        lockstep.spawn(_replay_phase, args=(list(slots), start, end, state, phase),
                       nprocs=len(slots), timeout=120, start_method="forkserver")
        state = phase
    replayed = torch.load(state, weights_only=True)["params"]
    for got, want in zip(result["params"], replayed, strict=True):
        assert torch.equal(got, want)
