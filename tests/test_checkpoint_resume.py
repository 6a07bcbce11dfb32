"""Crash recovery end to end: a SIGKILLed worker, ``lockstep run --max-restarts``, one restore call.

Two runs of ``tests/scripts/resume_train.py`` on 2 CPU workers (gloo), side by side: one
uninterrupted, one whose rank 1 kills itself mid-training once. The launcher restarts every
worker, they resume from the newest checkpoint, and the final weights must be bitwise equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"
RUN_TIMEOUT_S = 120


def _launch(work: Path, *extra: str, nproc: int = 2) -> subprocess.Popen:
    work.mkdir()
    command = [
        sys.executable, "-m", "lockstep", "run", "--max-restarts", "1", "--nproc-per-node", str(nproc),
        str(SCRIPT), "--ckpt", str(work / "ckpt"), "--out", str(work / "final.pt"), *extra,
    ]
    # One thread per worker: the same arithmetic in both runs, and no oversubscribed CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (work / "log.txt").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)


def _finish(proc: subprocess.Popen, work: Path) -> dict[str, torch.Tensor]:
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "timeout"
    log = (work / "log.txt").read_text()
    assert code == 0, f"run in {work} ended with {code}:\n{log[-4000:]}"
    return torch.load(work / "final.pt", weights_only=True)


@pytest.mark.multirank
def test_sigkilled_worker_resumes_bitwise_equal(tmp_path):
    marker = tmp_path / "killed-once"
    plain = _launch(tmp_path / "plain")
    killed = _launch(
        tmp_path / "killed", "--kill-rank", "1", "--kill-at-step", "7", "--marker", str(marker)
    )
    reference = _finish(plain, tmp_path / "plain")
    resumed = _finish(killed, tmp_path / "killed")
    # The run finished although rank 1 SIGKILLed itself: the launcher restarted the workers.
    assert marker.exists(), "rank 1 was never killed: the test proved nothing"
    assert reference.keys() == resumed.keys()
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after the resume"
    # Steps 3 and 6 were saved before the kill; after it, 6 was restored and 9, 12, 15 saved.
    names = sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir())
    assert names == ["step_000000000012", "step_000000000015"]


@pytest.mark.slow
@pytest.mark.multirank
def test_sigkilled_worker_resumes_bitwise_equal_with_async_saves(tmp_path):
    """The same kill with saves written in the background: still bitwise, still complete."""
    marker = tmp_path / "killed-once"
    plain = _launch(tmp_path / "plain")
    killed = _launch(tmp_path / "killed", "--async-save", "--kill-rank", "1", "--kill-at-step",
                     "7", "--marker", str(marker))
    reference = _finish(plain, tmp_path / "plain")
    resumed = _finish(killed, tmp_path / "killed")
    assert marker.exists(), "rank 1 was never killed: the test proved nothing"
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after the resume"
    # The last save (step 15) was asynchronous: the end of the process waited for it. Beside
    # the checkpoints, only the ranks' liveness locks.
    names = sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir())
    assert names == [".lockstep-alive", "step_000000000012", "step_000000000015"]


@pytest.mark.slow
@pytest.mark.multirank
def test_sigkilled_worker_resumes_bitwise_equal_at_world_3(tmp_path):
    """Three workers, residual blocks in small shared buckets: a 3-way sum is rounded the same way
    only if the resumed job reduces with the uninterrupted job's bucket layout."""
    marker = tmp_path / "killed-once"
    plain = _launch(tmp_path / "plain", "--model", "blocks", nproc=3)
    killed = _launch(tmp_path / "killed", "--model", "blocks", "--kill-rank", "2",
                     "--kill-at-step", "5", "--marker", str(marker), nproc=3)
    reference = _finish(plain, tmp_path / "plain")
    resumed = _finish(killed, tmp_path / "killed")
    assert marker.exists(), "rank 2 was never killed: the test proved nothing"
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after the resume"
