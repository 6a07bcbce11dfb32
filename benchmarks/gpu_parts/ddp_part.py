"""Part ``ddp``: step time at world 1 (bare, lockstep, torch, alternating) and world 2 bitwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from gpu_parts.common import (
    Config,
    Section,
    batch_of,
    deterministic,
    lm_loss,
    median,
    median_time,
    params_equal,
    spawn_shared,
    transformer,
)

__all__ = ["run"]


def _stepper(model: torch.nn.Module, cfg: Config, rank: int = 0):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"step": 0}

    def step() -> None:
        x, y = batch_of(cfg, state["step"], rank)
        opt.zero_grad(set_to_none=False)
        lm_loss(model(x), y).backward()
        opt.step()
        state["step"] += 1

    return step


def world1_worker(rank: int, cfg: Config) -> dict:
    lockstep.init_distributed(device=cfg.device)
    models = {
        "bare": transformer(cfg),
        "lockstep": lockstep.DistributedDataParallel(transformer(cfg)),
        "torch": TorchDDP(transformer(cfg), device_ids=[0] if cfg.cuda else None),
    }
    steps = {name: _stepper(m, cfg) for name, m in models.items()}
    for fn in steps.values():  # warm-up: first-iteration bucket rebuild, allocator, kernels
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(cfg.rounds):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate, so drift hits all alike
            times[name].append(median_time(steps[name], cfg.steps, cfg.device))
    params = sum(p.numel() for p in models["bare"].parameters())
    return {"times": times, "params": params}


def world2_worker(rank: int, cfg: Config, backend: str) -> dict:
    deterministic(cfg)
    lockstep.init_distributed(backend=backend, device=cfg.device)
    ours = lockstep.DistributedDataParallel(transformer(cfg))
    theirs = TorchDDP(transformer(cfg), device_ids=[0] if cfg.cuda and backend == "nccl" else None)
    for model in (ours, theirs):
        step = _stepper(model, cfg, rank)
        for _ in range(cfg.check_steps):
            step()
    ok, where = params_equal(ours.module, theirs.module)
    dist.barrier()
    return {"equal": ok, "where": where}


def run(cfg: Config) -> Section:
    section = Section("ddp", "DDP on a transformer: step time at world 1, bitwise at world 2")
    out = lockstep.spawn(world1_worker, 1, args=(cfg,), timeout=540)[0]
    times = out["times"]
    bare, ours, theirs = (median(times[k]) for k in ("bare", "lockstep", "torch"))
    per_round = [(o / b, o / t) for o, b, t in zip(times["lockstep"], times["bare"], times["torch"])]
    r_bare = median([a for a, _ in per_round])
    r_torch = median([b for _, b in per_round])
    section.lines.append(f"{out['params'] / 1e6:.3g}M parameters, {cfg.dtype_name}, batch {cfg.batch} x "
                         f"{cfg.context} tokens, {cfg.rounds} alternating rounds of {cfg.steps} steps "
                         "(medians).")
    section.lines.append("")
    section.table(["world 1", "bare ms", "lockstep ms", "torch DDP ms", "lockstep/bare", "target",
                   "lockstep/torch", "target"],
                  [["step", bare * 1e3, ours * 1e3, theirs * 1e3, r_bare, "<= 1.01", r_torch, "<= 1.00"]])
    if not cfg.dry_run:
        section.check(r_bare <= 1.01, f"lockstep/bare {r_bare:.3f} > 1.01")
        section.check(r_torch <= 1.00, f"lockstep/torch DDP {r_torch:.3f} > 1.00")
    results = spawn_shared(world2_worker, cfg, section)
    rows = [[rank, cfg.check_steps, section.check(r["equal"], f"world 2 rank {rank}: parameters differ "
                                                  f"from torch DDP at {r['where']}"), r["where"] or "-"]
            for rank, r in enumerate(results)]
    section.table(["world 2 rank", "steps", "parameters bitwise equal to torch DDP", "first difference"], rows)
    section.data.update({"params": out["params"], "times_s": times, "lockstep_over_bare": r_bare,
                         "lockstep_over_torch": r_torch, "world2": results})
    return section
