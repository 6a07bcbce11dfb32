"""Pipeline parallelism measured against its theory, and against splitting the data instead.

Usage::

    python benchmarks/bench_pipeline.py                 # all three tables, CPU, gloo
    python benchmarks/bench_pipeline.py --only memory   # or: bubble, split
    python benchmarks/bench_pipeline.py --microbatches 1 2 4 8 --steps 4

Three tables, side by side in one run:

* ``memory``: peak activation bytes per stage (autograd's saved tensors plus the stage's
  inputs and outputs kept for backward, counted by ``saved_tensors_hooks``), GPipe and 1F1B,
  beside the theory: the bytes a micro-batch keeps in a stage of two Linear+GELU blocks
  (5 activations of ``b/m x width`` floats) times the micro-batches the stage holds at once
  (``m`` in GPipe, ``min(p - s, m)`` in 1F1B). One process, CPU stages.
* ``bubble``: the idle share of each stage, measured with one stage per rank (gloo): one minus
  the stage's compute time over the step's span from the first forward to the last backward of
  any rank, beside ``(p - 1) / (m + p - 1)``. The formula counts only compute: time spent
  sending activations, or waiting for a busy CPU, shows as extra bubble.
* ``split``: the same MLP trained by 2 ranks as data parallelism (lockstep's DDP) and as a
  2-stage pipeline (1F1B): parameters, gradients and Adam state per rank, measured peak
  activations per rank, and step time.

Times on a shared CPU are noisy; read ratios, and rerun on an idle machine for absolutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.pipeline.schedule import bubble_fraction, get_schedule, in_flight_peaks

KIB = 1024


def mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear+GELU blocks of ``width``: equal layers, so stages balance exactly."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def memory_table(stages: int, microbatches: int, width: int, batch: int) -> None:
    print(f"\n## Peak activation memory per stage (p={stages}, m={microbatches}, "
          f"batch {batch}, width {width})\n")
    print("| stage | GPipe measured KiB | GPipe theory KiB | 1F1B measured KiB | "
          "1F1B theory KiB | GPipe / 1F1B |")
    print("|---|---|---|---|---|---|")
    peaks, theory = {}, {}
    for name in ["gpipe", "1f1b"]:
        pipe = lockstep.Pipeline(mlp(width, 2 * stages), microbatches, schedule=name,
                                 loss_fn=lambda out: out.pow(2).mean(), devices=["cpu"] * stages)
        pipe.step(torch.randn(batch, width))
        # Per micro-batch, each Linear+GELU block saves two tensors (the Linear's input and
        # the GELU's input) and the stage keeps its output: (2 * blocks + 1) activations.
        per_mb = (2 * 2 + 1) * (batch // microbatches) * width * 4
        in_flight = in_flight_peaks(get_schedule(name, stages, microbatches))
        peaks[name] = [s.peak_activation_bytes for s in pipe.stats]
        theory[name] = [n * per_mb for n in in_flight]
    for s in range(stages):
        print(f"| {s} | {peaks['gpipe'][s] / KIB:.0f} | {theory['gpipe'][s] / KIB:.0f} | "
              f"{peaks['1f1b'][s] / KIB:.0f} | {theory['1f1b'][s] / KIB:.0f} | "
              f"{peaks['gpipe'][s] / peaks['1f1b'][s]:.2f}x |")


def _bubble_worker(rank: int, schedule: str, microbatches: int, width: int, depth: int,
                   batch: int, steps: int) -> list:
    lockstep.init_distributed()
    torch.set_num_threads(1)
    pipe = lockstep.Pipeline(mlp(width, depth), microbatches, schedule=schedule,
                             loss_fn=lambda out: out.pow(2).mean())
    x = torch.randn(batch, width)
    spans = []
    for _ in range(steps + 1):  # the first step warms up allocators and connections
        dist.barrier()
        pipe.step(*((x,) if rank == 0 else ()))
        events = pipe.stats[0].events
        spans.append((events[0][1], events[-1][2], pipe.stats[0].busy_s))
    return spans[1:]


def bubble_table(stages: int, microbatches: list[int], width: int, batch: int,
                 steps: int) -> None:
    print(f"\n## Bubble: idle share per stage, {stages} ranks (gloo, CPU, 1 thread each), "
          f"batch {batch}, width {width}\n")
    print("| m | schedule | measured bubble | theory (p-1)/(m+p-1) | measured / theory | "
          "step ms |")
    print("|---|---|---|---|---|---|")
    for m in microbatches:
        for name in ["gpipe", "1f1b"]:
            per_rank = lockstep.spawn(_bubble_worker, stages,
                                      (name, m, width, 2 * stages, batch, steps), timeout=300)
            bubbles, spans = [], []
            for step in range(steps):
                start = min(r[step][0] for r in per_rank)
                end = max(r[step][1] for r in per_rank)
                spans.append(end - start)
                bubbles += [1 - r[step][2] / (end - start) for r in per_rank]
            measured = statistics.median(bubbles)
            theory = bubble_fraction(stages, m)
            ratio = f"{measured / theory:.2f}" if theory else "-"
            print(f"| {m} | {name} | {measured:.3f} | {theory:.3f} | {ratio} | "
                  f"{statistics.median(spans) * 1e3:.0f} |")


def _split_worker(rank: int, how: str, width: int, depth: int, batch: int, chunks: int,
                  steps: int) -> dict:
    lockstep.init_distributed()
    torch.set_num_threads(1)
    x, loss_fn = torch.randn(batch, width), (lambda out: out.pow(2).mean())
    if how == "ddp":
        model = lockstep.DistributedDataParallel(mlp(width, depth))
        half = x.chunk(2)[rank]
        # A one-stage pipeline measures what autograd keeps for this rank's half-batch.
        probe = lockstep.Pipeline(mlp(width, depth), 1, loss_fn=loss_fn, devices=["cpu"])
        probe.step(half)
        activations = probe.stats[0].peak_activation_bytes

        def step() -> None:
            loss_fn(model(half)).backward()
    else:
        model = lockstep.Pipeline(mlp(width, depth), chunks, loss_fn=loss_fn)

        def step() -> None:
            model.step(*((x,) if rank == 0 else ()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        step()
        opt.step()
        times.append(time.perf_counter() - start)
    if how != "ddp":
        activations = model.stats[0].peak_activation_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": params, "activations": activations, "step": statistics.median(times[1:])}


def split_table(width: int, depth: int, batch: int, chunks: int, steps: int) -> None:
    print(f"\n## Split the data or the model: 2 ranks, MLP of {depth} x Linear({width}), "
          f"batch {batch}, Adam, pipeline 1F1B with m={chunks}\n")
    print("| | weights+grads+Adam per rank MiB | peak activations per rank MiB | "
          "step ms | step time vs DDP |")
    print("|---|---|---|---|---|")
    rows = {}
    for how in ["ddp", "pipeline"]:
        per_rank = lockstep.spawn(_split_worker, 2, (how, width, depth, batch, chunks, steps),
                                  timeout=300)
        rows[how] = (
            max(r["params"] for r in per_rank) * 4 / 2**20,  # weights, grads, 2 Adam moments
            max(r["activations"] for r in per_rank) / 2**20,
            max(r["step"] for r in per_rank) * 1e3,
        )
    for how, (state, acts, step) in rows.items():
        label = "data parallel (DDP)" if how == "ddp" else "pipeline (2 stages)"
        print(f"| {label} | {state:.1f} | {acts:.1f} | {step:.0f} | "
              f"{step / rows['ddp'][2]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["memory", "bubble", "split"])
    parser.add_argument("--stages", type=int, default=2, help="ranks in the bubble table")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.only in (None, "memory"):
        memory_table(4, 8, width=512, batch=64)
    if args.only in (None, "bubble"):
        bubble_table(args.stages, args.microbatches, args.width, args.batch, args.steps)
    if args.only in (None, "split"):
        split_table(1024, 8, batch=64, chunks=4, steps=args.steps)


if __name__ == "__main__":
    main()
