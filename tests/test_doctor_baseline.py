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
