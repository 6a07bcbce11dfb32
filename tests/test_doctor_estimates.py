"""lockstep doctor's actions and account lines on recorded data stragglers (lockstep/doctor/account.py).

Pure logic on synthetic rank files: no process is started and nothing is timed. Each step is
data ``d``, forward 20 ms, backward 40 ms, then ``e`` waiting for the all-reduce, optimizer 10
ms, with 5 ms gaps (``d + 90 ms + e``).
"""

from __future__ import annotations

from typing import Any

import pytest

from lockstep.doctor.account import speedup_account
from lockstep.doctor.command import findings_text
from lockstep.doctor.profile_file import build_profile


def _step(t0: float, d: float, e: float) -> dict[str, Any]:
    f = t0 + d
    return {"begin": t0, "end": f + 0.09 + e, "forwards": [[f, f, f + 0.02]],
            "backwards": [[f + 0.025, f + 0.065, f + 0.07 + e]],
            "optimizer": [[f + 0.075 + e, f + 0.085 + e]], "buckets": []}


def _rank(rank: int, world: int, d: float, e: float = 0.0, steps: int = 12) -> dict[str, Any]:
    return {"format": "lockstep-profile-rank", "version": 1, "rank": rank, "world_size": world,
            "host": "h", "backend": "gloo" if world > 1 else None, "device": "cpu",
            "device_name": None, "torch": "2.13.0", "mode": "ddp", "batch_size_per_rank": 32,
            "model": {}, "buckets": [], "warmup": 2, "wall_offset": 0.0,
            "steps": [_step(k * (d + 0.09 + e), d, e) for k in range(steps)]}


def _two_ranks(slow_data: float) -> dict[str, Any]:
    """Rank 1 loads for ``slow_data`` s; rank 0 for 5 ms and waits the difference."""
    return build_profile([_rank(0, 2, 0.005, e=0.005 + slow_data - 0.005),
                          _rank(1, 2, slow_data, e=0.005)])


@pytest.mark.parametrize("alone_data", [0.005, 0.02, 0.055, 0.06])
def test_no_estimate_pushes_the_speedup_past_the_ideal(alone_data):
    """Rank 1 waits 50 ms more for data; the 1-worker run waits ``alone_data``. Removing the
    wait from the 2-worker step alone gave 2.09x (0.02) and 2.86x (0.06) from the ideal 2x
    (until 2026-11-29)."""
    acc = speedup_account(build_profile([_rank(0, 1, alone_data)]), _two_ranks(0.055))
    assert acc.actions
    for action in acc.actions:
        assert acc.measured + action.gain <= acc.ideal + 1e-9, (action, acc.table())


def test_the_straggler_estimate_takes_the_baselines_share_of_the_slowness_out_too():
    """The 1-worker run waits 15 ms more for data than the waiting ranks do: fixing rank 1's
    loader takes those 15 ms out of the 1-worker step too."""
    one, many = build_profile([_rank(0, 1, 0.02)]), _two_ranks(0.055)
    acc = speedup_account(one, many)
    assert not acc.data_bound
    strag = many["attribution"]["straggler"]
    assert (strag["rank"], strag["phase"]) == (1, "data")
    t1, tn = one["phases"]["step"], many["phases"]["step"]
    saved_1 = one["phases"]["data"] - many["attribution"]["baseline"]["data"]
    assert saved_1 == pytest.approx(0.015)
    expected = 2 * (t1 - saved_1) / (tn - strag["waited_s"]) - acc.measured
    (action,) = [a for a in acc.actions if "rank 1 waits" in a.text]
    assert action.gain == pytest.approx(expected)
    assert 0 < action.gain < acc.ideal - acc.measured


def test_a_loader_slow_on_every_rank_is_data_bound_not_a_straggler():
    """Every rank's loader takes 55 ms; rank 0's prefetches while it waits at the all-reduce,
    so only rank 1 shows it; the 1-worker run waits 60 ms. Until 2026-11-29: "straggler rank 1
    in data", advice for rank 1 only, and two large lines offsetting each other."""
    one, many = build_profile([_rank(0, 1, 0.06)]), _two_ranks(0.055)
    acc = speedup_account(one, many)
    assert acc.data_bound
    table = acc.table()
    assert "straggler" not in table and "data, slow on every rank" in table
    keys = [loss.key for loss in acc.losses]
    assert keys.count("data") == 1 and "straggler" not in keys
    (data,) = [loss for loss in acc.losses if loss.key == "data"]
    assert abs(data.seconds) < 0.01  # the net: the wait less the data time it hides
    total = acc.measured + sum(x.speedup for x in acc.losses) + acc.unexplained.speedup
    assert total == pytest.approx(2)
    assert "every rank" in acc.actions[0].text and "rank 1 waits" not in table
    findings = findings_text(many, acc)
    assert "data-bound on every rank, not one slow rank" in findings
    assert "straggler: rank" not in findings


def test_one_slow_host_is_still_a_straggler():
    """The 1-worker run loads as fast as the waiting ranks: rank 1 alone is slow."""
    one, many = build_profile([_rank(0, 1, 0.005)]), _two_ranks(0.055)
    acc = speedup_account(one, many)
    assert not acc.data_bound
    assert "straggler rank 1 in data" in acc.table()
    assert "straggler: rank 1" in findings_text(many, acc)


def test_a_measured_speedup_above_the_ideal_says_the_runs_were_noisy():
    one, many = build_profile([_rank(0, 1, 0.2)]), _two_ranks(0.005)
    acc = speedup_account(one, many)
    assert acc.measured > acc.ideal
    assert "the runs were noisy" in acc.table()
    fine = speedup_account(build_profile([_rank(0, 1, 0.005)]), _two_ranks(0.005))
    assert "noisy" not in fine.table()
