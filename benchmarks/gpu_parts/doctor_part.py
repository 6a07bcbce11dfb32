"""Part ``doctor``: the profiler's cost (CUDA events on vs off) and ``lockstep doctor`` end to end."""

from __future__ import annotations

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

SCRIPT = '''
import torch, lockstep
from torch import nn
info = lockstep.init_distributed()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(info.device)
model = lockstep.DistributedDataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=1e-3)
x = torch.randn(64, 256, device=info.device)
for step in range({steps}):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
lockstep.shutdown_distributed()
'''


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


def _cli(cfg: Config) -> tuple[int, float, str, list[str]]:
    steps = 30 if cfg.cuda else 8
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "train.py")
        script.write_text(SCRIPT.format(steps=steps))
        out_dir = Path(tmp, "doctor")
        cmd = [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "1", "--no-baseline",
               "--steps", str(steps), "--warmup", "2", "--out-dir", str(out_dir), str(script)]
        env = dict(os.environ)
        if not cfg.cuda:
            env["LOCKSTEP_DEVICE"] = "cpu"
        start = time.perf_counter()
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=cfg.repo)
        wall = time.perf_counter() - start
        files = sorted(p.name for p in out_dir.glob("*")) if out_dir.exists() else []
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return proc.returncode, wall, " / ".join(tail)[:300], files


def run(cfg: Config) -> Section:
    section = Section("doctor", "lockstep doctor: profiler overhead (CUDA events) and the CLI")
    times = lockstep.spawn(worker, 1, args=(cfg,), timeout=540)[0]
    off, on = median(times["off"]), median(times["on"])
    section.table(["profiling", "step ms", "on / off"],
                  [["off", off * 1e3, 1.0], ["on (CUDA events)" if cfg.cuda else "on (CPU clock)", on * 1e3,
                                             on / off]])
    code, wall, tail, files = _cli(cfg)
    section.table(["`lockstep doctor --nproc-per-node 1 --no-baseline`", "exit", "wall s", "files written"],
                  [["small DDP script", section.check(code == 0, f"lockstep doctor exited {code}: {tail}")
                    if code else "0", wall, ", ".join(files) or "-"]])
    section.data.update({"times_s": times, "overhead": on / off, "cli": {"exit": code, "wall_s": wall,
                                                                          "files": files, "tail": tail}})
    return section
