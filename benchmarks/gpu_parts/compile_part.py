"""Part ``compile``: lockstep DDP eager and compiled against torch's compiled DDP (world 1)."""

from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from gpu_parts.common import Config, Section, batch_of, lm_loss, median, median_time, transformer

__all__ = ["run"]

VARIANTS = ["lockstep eager", "lockstep compiled", "torch compiled"]


def worker(rank: int, cfg: Config) -> dict:
    lockstep.init_distributed(device=cfg.device)
    backend = "inductor" if cfg.cuda else "aot_eager"  # a dry run needs no C++ compiler
    steps, ddps = {}, {}
    for variant in VARIANTS:
        net = transformer(cfg)
        ddp: nn.Module = (lockstep.DistributedDataParallel(net) if variant.startswith("lockstep")
                          else TorchDDP(net, device_ids=[0] if cfg.cuda else None))
        model = ddp if variant.endswith("eager") else torch.compile(ddp, backend=backend)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        ddps[variant] = ddp

        def step(model=model, opt=opt) -> None:
            x, y = batch_of(cfg, 0, rank)
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            opt.step()

        for _ in range(3):  # compiles, and fixes lockstep's bucket layout
            step()
        steps[variant] = step
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(cfg.rounds):
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            times[v].append(median_time(steps[v], cfg.steps, cfg.device))
    exposed = {}
    for v in VARIANTS[:2]:  # lockstep's own profiler gives the exposed share
        ddp = ddps[v]
        assert isinstance(ddp, lockstep.DistributedDataParallel)
        profiler = ddp.enable_profiling(warmup=0)
        for _ in range(cfg.steps):
            steps[v]()
        phases = profiler.step_phases()
        exposed[v] = statistics.median(p["exposed_comm"] / p["step"] for p in phases) if phases else None
        ddp.enable_profiling(False)
    return {"times": times, "exposed": exposed, "backend": backend}


def run(cfg: Config) -> Section:
    section = Section("compile", "torch.compile: lockstep DDP eager and compiled vs torch's compiled DDP")
    out = lockstep.spawn(worker, 1, args=(cfg,), timeout=540)[0]
    times = out["times"]
    ref = median(times["torch compiled"])
    rows = [[v, median(times[v]) * 1e3, median(times[v]) / ref,
             "-" if out["exposed"].get(v) is None else f"{100 * out['exposed'][v]:.1f}%"] for v in VARIANTS]
    section.lines.append(f"world 1, backend {out['backend']}, {cfg.rounds} alternating rounds of "
                         f"{cfg.steps} steps (medians).")
    section.lines.append("")
    section.table(["variant", "step ms", "/ torch compiled", "exposed share"], rows)
    section.data.update(out)
    return section
