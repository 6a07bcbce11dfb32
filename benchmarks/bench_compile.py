"""DDP under torch.compile, side by side: eager lockstep, compiled lockstep, compiled torch DDP.

Usage::

    python benchmarks/bench_compile.py              # CPU, gloo, world 2, inductor
    python benchmarks/bench_compile.py --quick      # fewer steps, one repetition
    python benchmarks/bench_compile.py --device cuda --width 4096

Variants, each in fresh processes (one thread per rank on CPU), alternating within a repetition:

- ``lockstep eager``: ``lockstep.DistributedDataParallel(net)``.
- ``lockstep compiled``: ``torch.compile(lockstep.DistributedDataParallel(net))``; the graph is
  split at the bucket boundaries (lockstep/ddp/compiled.py).
- ``lockstep compiled, unsplit``: the same with the split turned off (one piece), i.e. what
  compiling did before the split: every all-reduce starts after the whole backward.
- ``torch compiled``: ``torch.compile(torch.nn.parallel.DistributedDataParallel(net))``
  (torch's own split, its DDPOptimizer, where Dynamo traces the module: on torch 2.13 CPU it
  breaks the graph in DDP's forward and the module runs eagerly; see docs/ddp.md).
- ``torch, compiled inside``: ``torch.nn.parallel.DistributedDataParallel(torch.compile(net))``
  (the module is compiled, and split by the DDPOptimizer when it compiles inside DDP's forward).
- ``torch eager``: ``torch.nn.parallel.DistributedDataParallel(net)``.

The two ratio columns divide by each of torch's two compiled forms.

Step time is the median over the timed steps, best of the repetitions (shared machines are
noisy), taken with nothing recording. "exposed" is the share of lockstep's step spent waiting,
after backward, for all-reduces it did not hide (lockstep's profiler, the same measure
``lockstep doctor`` uses), from as many further steps with the profiler on; torch's DDP has no
such record, so it gets the step time only. Compilation happens in the
warm-up steps, outside the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.ddp import compiled as compiled_module

VARIANTS = ["lockstep eager", "lockstep compiled", "lockstep compiled, unsplit", "torch compiled",
            "torch, compiled inside", "torch eager"]
TORCH_COMPILED = ["torch compiled", "torch, compiled inside"]


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(width, 16))


def _unsplit(self: compiled_module.BucketSplitter, gm: torch.fx.GraphModule, example_inputs):
    return self.backend(gm, example_inputs)  # the whole graph as one piece


def run_variant(rank: int, variant: str, args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        torch.set_num_threads(1)
    info = lockstep.init_distributed(device=args.device)
    device = info.device
    net = mlp(args.width, args.layers).to(device)
    if variant == "lockstep compiled, unsplit":
        compiled_module.BucketSplitter.__call__ = _unsplit  # type: ignore[method-assign]
    if variant.startswith("torch"):
        inner = torch.compile(net, backend=args.backend) if variant.endswith("inside") else net
        ddp: nn.Module = nn.parallel.DistributedDataParallel(
            inner, bucket_cap_mb=args.bucket_cap_mb,
            device_ids=[device.index] if device.type == "cuda" else None)
    else:
        ddp = lockstep.DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb)
    plain = variant.endswith(("eager", "inside"))
    model = ddp if plain else torch.compile(ddp, backend=args.backend)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, 16, generator=g).to(device)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):  # compiles, and fixes lockstep's bucket layout
        step()
    times = []
    for _ in range(args.steps):  # timed with nothing recording: the step a user runs
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # Whether the module really ran compiled: the output's autograd node tells.
    probe = model(x)
    ran = "compiled" if "Compiled" in type(probe.grad_fn).__name__ else "eager"
    F.mse_loss(probe, y).backward()  # a whole step, so every variant ends the same way
    out: dict = {"step_s": statistics.median(times), "exposed": None, "exposed_s": None,
                 "ran": ran}
    lockstep_ddp = ddp if isinstance(ddp, lockstep.DistributedDataParallel) else None
    if lockstep_ddp is not None:  # then as many steps again with lockstep's profiler on
        profiler = lockstep_ddp.enable_profiling(warmup=0)
        for _ in range(args.steps):
            step()
        phases = profiler.step_phases()
        out["exposed_s"] = statistics.median(p["exposed_comm"] for p in phases)
        out["exposed"] = statistics.median(p["exposed_comm"] / p["step"] for p in phases)
        out["backward_s"] = statistics.median(p["backward"] + p["exposed_comm"] for p in phases)
        lockstep_ddp.enable_profiling(False)
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--bucket-cap-mb", type=float, default=5.0)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="12 steps, one repetition")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 12, 4, 1

    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:  # alternate, so drift in machine load hits all alike
            results = lockstep.spawn(run_variant, args.world, (variant, args),
                                     timeout=args.timeout)
            slowest = max(results, key=lambda r: r["step_s"])
            samples[variant].append({**results[0], "step_s": slowest["step_s"]})
    best = {v: min(samples[v], key=lambda s: s["step_s"]) for v in VARIANTS}
    print(f"\nDDP under torch.compile ({args.backend}), {args.device}, world {args.world}, "
          f"MLP {args.layers}x{args.width}, batch {args.batch}/rank, buckets "
          f"{args.bucket_cap_mb:g} MB; best of {args.repeats} repetition(s), median of "
          f"{args.steps} steps")
    print("| variant | module ran | step (ms) | backward incl. exposed (ms) | exposed comm (ms) | exposed share "
          "| / torch compiled | / torch, compiled inside |")
    print("|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        s = best[v]
        bwd = f"{s['backward_s'] * 1e3:.1f}" if s.get("backward_s") is not None else "-"
        exp_ms = f"{s['exposed_s'] * 1e3:.1f}" if s["exposed_s"] is not None else "-"
        share = f"{s['exposed'] * 100:.1f}%" if s["exposed"] is not None else "-"
        print(f"| {v} | {s['ran']} | {s['step_s'] * 1e3:.1f} | {bwd} | {exp_ms} | {share} "
              f"| {s['step_s'] / best[TORCH_COMPILED[0]]['step_s']:.3f} "
              f"| {s['step_s'] / best[TORCH_COMPILED[1]]['step_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
