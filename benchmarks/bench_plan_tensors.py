"""Does the planner miss a per-gradient cost? Same bytes and FLOPs, different tensor counts.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_tensors.py

A stack of ``k`` ``Linear(d, d)`` layers with ``k * d**2`` fixed (1.33M parameters, 5.3 MB of
gradients, the same FLOPs per sample) has ``2k`` gradient tensors; the DDP reducer does some
work per tensor (a hook, a copy into its bucket) that a world-1 profile does not contain. For
each ``k`` it profiles world 1 in a fresh one-thread process, runs lockstep's DDP at worlds 2
and 3 (gloo on CPU; the run measures its own link first, as ``bench_plan.py`` does) and prints
measured and predicted steps (``cpu_cores`` = this machine's cores). At world 3 on a 2-core
machine three ranks time-share two cores, so the step implies each rank's CPU work beyond its
world-1 compute, ``(step - data) * cores / world - compute``: printed beside the model's. A
cost per tensor shows as a gap that grows with ``k``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.plan.measure import DEFAULT_SIZES
from lockstep.plan.validate import cpu_cores, measure_ddp, predict_ddp, profile_world1, workload_of

WIDTH = {4: 576, 16: 288, 64: 144, 144: 96}  # k * d**2 = 1,327,104 weights each
BATCH = 64


def _stack(k: int) -> nn.Module:
    d = WIDTH[k]
    return nn.Sequential(*[m for _ in range(k) for m in (nn.Linear(d, d), nn.ReLU())])


# Module-level builders: the ranks are new processes.
def build_4() -> nn.Module:
    return _stack(4)


def build_16() -> nn.Module:
    return _stack(16)


def build_64() -> nn.Module:
    return _stack(64)


def build_144() -> nn.Module:
    return _stack(144)


def batch_4() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH[4]), torch.randn(BATCH, WIDTH[4])


def batch_16() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH[16]), torch.randn(BATCH, WIDTH[16])


def batch_64() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH[64]), torch.randn(BATCH, WIDTH[64])


def batch_144() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH[144]), torch.randn(BATCH, WIDTH[144])


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


CASES = {4: (build_4, batch_4), 16: (build_16, batch_16), 64: (build_64, batch_64),
         144: (build_144, batch_144)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", type=int, default=list(CASES), choices=list(CASES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cores = cpu_cores()
    print(f"{cores} cores; 5.3 MB of gradients in every row")
    print("| layers | tensors | world | world-1 compute ms | measured step ms | predicted ms "
          "| error | implied CPU work per rank ms: measured / model |")
    print("|---|---|---|---|---|---|---|---|")
    for k in args.layers:
        build, batch = CASES[k]
        doc = profile_world1(build, batch, loss, steps=args.steps, batch_size=BATCH)
        workload = workload_of(doc)
        compute = workload.forward + workload.backward + workload.optimizer + workload.other
        for world in args.worlds:
            got = measure_ddp(build, batch, loss, world, steps=args.steps,
                              sweep_sizes=DEFAULT_SIZES)
            pred = predict_ddp(workload, got["link"].link, world, cpu_cores=cores)
            ms = got["step_s"]
            implied = "-"
            if world > cores:
                share = cores / world
                implied = (f"{((ms - workload.data) * share - compute) * 1e3:.1f} / "
                           f"{((pred.step_s - workload.data) * share - compute) * 1e3:.1f}")
            print(f"| {k} | {2 * k} | {world} | {compute * 1e3:.1f} | {ms * 1e3:.1f} "
                  f"| {pred.step_s * 1e3:.1f} | {(pred.step_s / ms - 1) * 100:+.0f}% "
                  f"| {implied} |", flush=True)


if __name__ == "__main__":
    main()
