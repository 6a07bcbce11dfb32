"""Tests of benchmarks/gpu_acceptance.py: its dry run on CPU, so the GPU script never rots.

The dry run runs every part's plumbing (gloo, CPU tensors, tiny sizes) and must pass; the report
it writes must say it is a dry run, so no CPU figure is ever read as a GPU one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_acceptance.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_acceptance import PARTS, render


def test_render_marks_a_dry_run_and_keeps_part_order() -> None:
    part = {"title": "t", "lines": ["x"], "data": {}, "failures": [], "notes": ["n"], "seconds": 1.0,
            "dry_run": True, "when": "now"}
    text = render({"fsdp": {**part, "failures": ["bad"]}, "env": part})
    assert "Dry run on CPU" in text
    assert text.index("## env") < text.index("## fsdp") and "[env](#env)" in text
    assert "**FAIL** (1)" in text and "**failed:** bad" in text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dry_run_runs_every_part(tmp_path: Path) -> None:
    report = tmp_path / "gpu-acceptance.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--report", str(report)],
                          capture_output=True, text=True, cwd=REPO, timeout=230, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("# GPU acceptance report") and "Dry run on CPU" in text
    data = json.loads(report.with_suffix(".json").read_text())["parts"]
    assert list(data) == PARTS
    assert all(p["dry_run"] and not p["failures"] for p in data.values())
    assert all(r["equal"] for r in data["ddp"]["data"]["world2"])
    assert all(c["equal"] for rank in data["streams"]["data"]["cases"] for c in rank.values())
    # A part run alone is merged into the report already there.
    again = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "env", "--report", str(report)],
                           capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert list(json.loads(report.with_suffix(".json").read_text())["parts"]) == PARTS


def test_without_cuda_a_real_run_says_to_use_dry_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from gpu_acceptance import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
