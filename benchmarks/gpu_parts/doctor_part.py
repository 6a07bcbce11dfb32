"""Part ``doctor``: the profiler's cost (CUDA events on vs off) and ``lockstep doctor`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import lockstep
from gpu_parts.common import Config, Section, batch_of, lm_loss, median, median_time, transformer

__all__ = ["run"]

DEMO = "examples/train_gpt.py"


def _demo_args(cfg: Config, out: Path) -> list[str]:
    if cfg.cuda:
        size = ["--max-steps", "100", "--eval-interval", "1000", "--max-files", "200"]
    else:  # a dry run: a few steps of the demo on CPU
        size = ["--max-steps", "6", "--eval-interval", "1000", "--max-files", "12", "--device", "cpu"]
    return [DEMO, *size, "--sample-chars", "0", "--out-dir", str(out)]


def worker(rank: int, cfg: Config) -> dict:
    lockstep.init_distributed(device=cfg.device)
    net = transformer(cfg)
    ddp = lockstep.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step() -> None:
        x, y = batch_of(cfg, 0, rank)
        opt.zero_grad()
        lm_loss(ddp(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(cfg.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if mode == "on":
                ddp.enable_profiling(warmup=0)
            else:
                ddp.enable_profiling(False)
            times[mode].append(median_time(step, cfg.steps, cfg.device))
    ddp.enable_profiling(False)
    return times


def _demo(cfg: Config, profiled: bool, tmp: Path, k: int) -> dict:
    """The demo under ``lockstep run`` (profiling off) or ``lockstep doctor`` (on); its tokens/s."""
    out = tmp / f"demo-{'on' if profiled else 'off'}-{k}"
    if profiled:
        # --steps past the demo's own end: the doctor stops a run at --steps (default 40), and a
        # demo stopped early writes no metrics.json, so no tokens/s to compare with profiling off.
        cmd = ["doctor", "--nproc-per-node", "1", "--no-baseline", "--warmup", "2", "--steps", "1000",
               "--out-dir", str(tmp / f"doctor-{k}")]
    else:
        cmd = ["run", "--nproc-per-node", "1"]
    env = dict(os.environ)
    if not cfg.cuda:
        env["LOCKSTEP_DEVICE"] = "cpu"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lockstep", *cmd, *_demo_args(cfg, out)], check=False,
                          capture_output=True, text=True, timeout=240, env=env, cwd=cfg.repo)
    wall = time.perf_counter() - start
    metrics = out / "metrics.json"
    tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])[:300]
    files = sorted(p.name for p in (tmp / f"doctor-{k}").glob("*")) if profiled else []
    return {"exit": proc.returncode, "wall_s": wall, "tail": tail, "files": files,
            "tokens_per_s": json.loads(metrics.read_text())["tokens_per_s"] if metrics.exists() else None}


def run(cfg: Config) -> Section:
    section = Section("doctor", "lockstep doctor: profiler overhead (CUDA events) and the CLI")
    times = lockstep.spawn(worker, 1, args=(cfg,), timeout=540)[0]
    off, on = median(times["off"]), median(times["on"])
    section.table(["profiling", "step ms", "on / off"],
                  [["off", off * 1e3, 1.0], ["on (CUDA events)" if cfg.cuda else "on (CPU clock)", on * 1e3,
                                             on / off]])
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2 if cfg.cuda else 1):  # alternating: off, on, on, off
            for mode in ("off", "on") if k % 2 == 0 else ("on", "off"):
                runs[mode].append(_demo(cfg, mode == "on", Path(tmp), k))
    rows = []
    for mode in ("off", "on"):
        for r in runs[mode]:
            ok = r["exit"] == 0 and r["tokens_per_s"] is not None
            what = "`lockstep doctor --nproc-per-node 1 --no-baseline`" if mode == "on" else "`lockstep run --nproc-per-node 1`"
            rows.append([what, section.check(ok, f"demo under {what} exited {r['exit']}: {r['tail']}"),
                         f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", r["wall_s"], ", ".join(r["files"]) or "-"])
    section.lines.append(f"The demo (`{' '.join(_demo_args(cfg, Path('OUT')))}`), profiling off and on, alternating:")
    section.lines.append("")
    section.table(["run", "ok", "tokens/s", "wall s", "doctor files"], rows)
    section.data.update({"times_s": times, "overhead": on / off, "demo": runs})
    return section
