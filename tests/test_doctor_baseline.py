"""lockstep doctor when the 1-worker baseline run fails: the N-worker run is still explained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "doctor_needs_two_workers.py"


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_failed_baseline_still_explains_the_n_worker_run(tmp_path):
    out = tmp_path / "doctor"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", "6",
         "--warmup", "2", "--out-dir", str(out), str(SCRIPT)],
        check=False, capture_output=True, text=True, timeout=220, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the 1-worker run failed (exit 1)" in done.stderr
    assert "explaining the 2-worker run without it" in done.stderr
    assert "no speedup account: the 1-worker baseline run gave no profile" in done.stdout
    assert "findings:" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["account"] is None and "exit 1" in summary["baseline_error"]
    assert json.loads((out / "profile.json").read_text())["world_size"] == 2


def _doctor(tmp_path: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", "6",
         "--warmup", "2", "--out-dir", str(tmp_path / "doctor"), str(script), *args],
        check=False, capture_output=True, text=True, timeout=100, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_script_that_is_not_python_is_refused_before_any_run(tmp_path):
    """Until 2026-11-29 both runs started and printed the same SyntaxError."""
    script = tmp_path / "broken.py"
    script.write_text("import torch\ndef main(:\n    pass\n")
    done = _doctor(tmp_path, script)
    assert done.returncode == 2
    assert "broken.py is not valid Python" in done.stderr and "nothing was run" in done.stderr
    assert "running" not in done.stderr and "Traceback" not in done.stderr


def test_which_baseline_failures_would_fail_at_any_world(tmp_path):
    """Pure logic: what a failed 1-worker run leaves says whether the N-worker run is worth it."""
    from lockstep.doctor.command import _fails_at_any_world

    folder = tmp_path / "world1"
    folder.mkdir()
    # refused before training, exit 1 (Lightning's devices=2): the N-worker run is explained
    assert _fails_at_any_world(folder, 1, False, 2) is None
    assert "arguments" in (_fails_at_any_world(folder, 2, False, 2) or "")
    assert "warm-up" in (_fails_at_any_world(folder, 0, True, 2) or "")
    (folder / "rank0.json").write_text(json.dumps({"steps": [{}, {}, {}]}))
    assert "trained 3 step(s)" in (_fails_at_any_world(folder, 1, False, 2) or "")


_FAILS_MIDWAY = '''\
import argparse
import torch, torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fail-at", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(200):
    if step == args.fail_at:
        raise RuntimeError("deliberate failure midway")
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
'''


@pytest.mark.multirank
@pytest.mark.timeout(240)
@pytest.mark.parametrize("args, rc, why", [
    ((), 1, "trained 3 step(s) on 1 worker before it failed"),
    (("--bogus",), 2, "refusing its arguments"),
])
def test_a_baseline_failure_independent_of_the_worker_count_is_not_run_again(
        tmp_path, args, rc, why):
    """Until 2026-11-29 the 2-worker run started anyway and printed the same error again."""
    script = tmp_path / "fails.py"
    script.write_text(_FAILS_MIDWAY)
    done = _doctor(tmp_path, script, *args)
    assert done.returncode == rc, done.stderr[-3000:]
    assert "the 2-worker run is not started" in done.stderr and why in done.stderr
    assert "on 2 worker(s)" not in done.stderr
