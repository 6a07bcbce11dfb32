"""Part ``tests``: the GPU-marked tests, pass/fail per test (collection only in a dry run)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_parts.common import Config, Section

__all__ = ["run"]


def _outcomes(xml: Path) -> list[list[str]]:
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "**FAILED**", "error": "**ERROR**", "skipped": "skipped"}[tag]
                why = (child.get("message") or "").splitlines()[0][:120] if child.get("message") else ""
                break
        rows.append([name, outcome, why])
    return rows


def run(cfg: Config) -> Section:
    section = Section("tests", "GPU-marked tests (`pytest -m gpu`)")
    base = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    if cfg.dry_run:
        proc = subprocess.run(check=False, args=[*base, "--collect-only"], capture_output=True, text=True, cwd=cfg.repo,
                              timeout=300)
        names = [line for line in proc.stdout.splitlines() if "::" in line]
        section.notes.append("dry run: collected only, not run (they need CUDA)")
        section.table(["test", "outcome"], [[n, "collected"] for n in names])
        section.data["collected"] = names
        if proc.returncode not in (0, 5):  # 5: nothing collected
            section.failures.append(f"pytest --collect-only exited {proc.returncode}")
        return section
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp, "gpu.xml")
        try:
            proc = subprocess.run(check=False, args=[*base, f"--junitxml={xml}", "--timeout", "300"],
                                  capture_output=True, text=True, cwd=cfg.repo, timeout=570)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:  # over the 10-minute budget: say so, keep the other parts
            code = "killed after 570 s (run `python -m pytest -m gpu` file by file)"
            section.failures.append(f"the GPU tests took over 570 s: {code}")
        rows = _outcomes(xml) if xml.exists() else []
    for name, outcome, why in rows:
        if outcome.startswith("**"):
            section.failures.append(f"{name}: {why}")
    section.table(["test", "outcome", "message"], rows or [["(no results)", f"pytest exited {code}", ""]])
    section.data.update({"exit": code, "tests": rows})
    return section
