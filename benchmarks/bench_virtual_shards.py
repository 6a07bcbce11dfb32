"""The price of determinism: step time of VirtualShardDDP against lockstep's DDP, same world.

Usage::

    python benchmarks/bench_virtual_shards.py               # CPU, gloo, world 2, V=4
    python benchmarks/bench_virtual_shards.py --quick       # fewer steps and repetitions
    python benchmarks/bench_virtual_shards.py --world 4 --shards 8 --shard-size 16

Variants, each on the same global batch of ``shards * shard_size`` samples:

- ``ddp``: lockstep's DistributedDataParallel, one forward/backward of the local batch;
- ``ddp-accum``: the same DDP running the rank's ``V/N`` shards as micro-batches under
  ``no_sync`` (the compute of the virtual-shard mode, with torch's summation);
- ``virtual-flat``: VirtualShardDDP reducing after backward in one piece (``bucket_cap_mb=0``);
- ``virtual``: VirtualShardDDP with 1 MB buckets, reduced during the last shard's backward.

Every variant runs in fresh processes (one thread per rank), variants alternate within each
repetition, and the table reports medians: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.ddp.virtual_shards import VirtualShardDDP, split_shards

VARIANTS = ("ddp", "ddp-accum", "virtual-flat", "virtual")


def model() -> nn.Module:
    """~1.1M parameters: a small MLP with dropout (RNG per shard in the virtual mode)."""
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def run_variant(rank: int, variant: str, shards: int, shard_size: int, steps: int,
                warmup: int) -> float:
    """Seconds per step (median over ``steps``) of ``variant`` on this rank."""
    torch.set_num_threads(1)
    info = lockstep.init_distributed()
    torch.manual_seed(0)
    net = model()
    per_rank = shards // info.world_size
    x = torch.randn(per_rank * shard_size, 256)
    y = torch.randint(0, 10, (per_rank * shard_size,))
    opt: torch.optim.Optimizer
    if variant.startswith("virtual"):
        vs = VirtualShardDDP(net, shards, bucket_cap_mb=0.0 if variant == "virtual-flat" else 1.0)
        opt = torch.optim.SGD(vs.parameters(), lr=0.01)
        parts = split_shards((x, y), per_rank)

        def step(i: int) -> None:
            vs.train_step(parts, lambda m, b: F.cross_entropy(m(b[0]), b[1]), i)
            opt.step()
    else:
        ddp = lockstep.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        micro = split_shards((x, y), per_rank) if variant == "ddp-accum" else [(x, y)]

        def step(i: int) -> None:
            opt.zero_grad()
            for k, (xb, yb) in enumerate(micro):
                last = k == len(micro) - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (F.cross_entropy(ddp(xb), yb) / len(micro)).backward()
            opt.step()

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4, help="V, virtual shards")
    parser.add_argument("--shard-size", type=int, default=32, help="samples per virtual shard")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 repetition")
    args = parser.parse_args()
    steps, reps = (5, 1) if args.quick else (args.steps, args.reps)
    seen: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for variant in VARIANTS:  # alternate, so a busy spell hits every variant
            run_args = (variant, args.shards, args.shard_size, steps, 2)
            per_rank = lockstep.spawn(run_variant, args.world, run_args, timeout=600)
            seen[variant].append(max(per_rank))
    base = statistics.median(seen["ddp"])
    print(f"world {args.world}, V={args.shards}, shard size {args.shard_size}, "
          f"{steps} steps x {reps} repetitions, CPU/gloo, one thread per rank")
    print(f"{'variant':<12} {'ms/step':>8} {'vs ddp':>7}")
    for variant in VARIANTS:
        median = statistics.median(seen[variant])
        print(f"{variant:<12} {median * 1e3:8.1f} {median / base:6.2f}x")


if __name__ == "__main__":
    main()
