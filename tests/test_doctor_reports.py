"""lockstep doctor's report on recorded runs that end early, split their batch, or hide buckets.

Pure logic on synthetic rank files (``rank<R>.json`` as the recorder writes them): no process
is started and nothing is timed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lockstep.doctor.account import speedup_account
from lockstep.doctor.command import findings_text
from lockstep.doctor.profile_file import build_profile


def _step(t0: float, exposed: float = 0.0) -> dict[str, Any]:
    """One 100 ms step: data 10, forward 20, backward 40 (+ ``exposed``), optimizer 10."""
    return {"begin": t0, "end": t0 + 0.1 + exposed, "forwards": [[t0 + 0.01, t0 + 0.01, t0 + 0.03]],
            "backwards": [[t0 + 0.04, t0 + 0.08, t0 + 0.08 + exposed]],
            "optimizer": [[t0 + 0.085 + exposed, t0 + 0.095 + exposed]], "buckets": []}


def _rank(rank: int, world: int, steps: int, warmup: int, batch: int = 32,
          exposed: float = 0.0) -> dict[str, Any]:
    step_s = 0.1 + exposed
    return {"format": "lockstep-profile-rank", "version": 1, "rank": rank, "world_size": world,
            "host": "h", "backend": "gloo" if world > 1 else None, "device": "cpu",
            "device_name": None, "torch": "2.13.0", "mode": "ddp", "batch_size_per_rank": batch,
            "model": {}, "buckets": [], "warmup": warmup, "wall_offset": 0.0,
            "steps": [_step(k * step_s, exposed) for k in range(steps)]}


def _write(folder: Path, ranks: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    for r in ranks:
        (folder / f"rank{r['rank']}.json").write_text(json.dumps(r))
    return folder


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_that_ends_in_its_warmup_is_an_error_that_says_so(tmp_path, world):
    """3 steps of 5 warm-up ones: no statistics.StatisticsError (world 2), no all-zero report
    (world 1), but the step count and what to change."""
    from lockstep.doctor.command import _profile_of

    ranks = [_rank(r, world, steps=3, warmup=5) for r in range(world)]
    folder = _write(tmp_path / "w", ranks)
    with pytest.raises(ValueError, match="ended within its warm-up"):
        build_profile(ranks)
    with pytest.raises(ValueError, match=r"the script ended after 3 step\(s\), within the 5 "
                                         r"warm-up steps.*lower --warmup or let it run longer"):
        _profile_of(folder, warmup=5)


def test_a_batch_split_over_the_workers_is_compared_per_sample():
    """64 samples alone, 32 per worker at 2: half the work per step, so the speedup is in
    samples per second, not 2 * T1 / TN."""
    one = build_profile([_rank(0, 1, steps=10, warmup=2, batch=64)])
    many = build_profile([_rank(r, 2, steps=10, warmup=2, batch=32, exposed=0.02)
                          for r in range(2)])
    acc = speedup_account(one, many)
    t1, tn = one["phases"]["step"], many["phases"]["step"]
    assert acc.measured == pytest.approx(2 * 32 * t1 / (64 * tn))
    total = acc.measured + sum(x.speedup for x in acc.losses) + acc.unexplained.speedup
    assert total == pytest.approx(2)
    text = acc.table()
    assert "same batch per worker" not in text
    assert "batch 64" in text and "batch 32 per worker" in text
    assert "the batch per worker differs" in text and "samples per second" in text
    same = speedup_account(build_profile([_rank(0, 1, steps=10, warmup=2, batch=32)]), many)
    assert same.measured == pytest.approx(2 * t1 / tn) and "same batch per worker" in same.table()


def test_buckets_not_observed_are_said_so_and_suggest_no_comm_hook():
    """A comm hook registered before the first forward: no bucket is timed, so nothing is
    'hidden', and registering another hook (which torch refuses) is not suggested."""
    one = build_profile([_rank(0, 1, steps=10, warmup=2)])
    many = build_profile([_rank(r, 2, steps=10, warmup=2, exposed=0.02) for r in range(2)])
    att = many["attribution"]
    assert att["buckets_observed"] is False and att["exposed_comm_s"] > 0
    text = findings_text(many)
    assert "buckets not observed" in text
    assert "0 bucket(s)" not in text and "hid 100%" not in text
    actions = "\n".join(a.text for a in speedup_account(one, many).actions)
    assert "register_comm_hook" not in actions and "bucket_cap_mb" not in actions
    assert one["attribution"]["buckets_observed"] is True  # nothing to observe alone


def test_a_step_that_reduces_in_every_backward_has_no_negative_ready_times():
    """Accumulation without no_sync(): two backwards per step, each reducing bucket 0. Each
    bucket event belongs to the backward it came from (the plan refused ready < 0), and the
    communication per step counts both reductions."""
    ranks = []
    for r in range(2):
        rank = _rank(r, 2, steps=8, warmup=2)
        rank["buckets"] = [{"index": 0, "bytes": 2**20, "params": ["w"]}]
        for step in rank["steps"]:
            t0 = step["begin"]
            step["backwards"] = [[t0 + 0.02, t0 + 0.03, t0 + 0.035], [t0 + 0.06, t0 + 0.07, t0 + 0.08]]
            step["buckets"] = [
                {"index": 0, "ready": t0 + b + 0.011, "last_param": "w", "launch": t0 + b + 0.011,
                 "done": t0 + b + 0.014, "waited": t0 + b + 0.015}
                for b in (0.02, 0.06)]
        ranks.append(rank)
    profile = build_profile(ranks)
    (bucket,) = profile["buckets"]
    assert bucket["ready"] == pytest.approx(0.011)
    assert bucket["ready_share"] == 1.0  # handed over just after the last gradient: not 110%
    assert bucket["per_step"] == pytest.approx(2.0)
    assert bucket["exposed"] == pytest.approx(0.005)  # 15 ms waited - 10 ms compute, each time
    text = findings_text(profile)
    assert "2.00 MB per step (each bucket reduced 2 times per step" in text
