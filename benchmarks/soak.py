"""Soak test: thousands of DDP steps at world 2 with checkpoints and watched collectives.

Resident memory (RSS) of every rank is sampled as training goes; after warm-up it must stay
flat: a leak per step (a kept graph, a growing store, an unfreed bucket) shows as a slope.
Not part of CI: run it by hand::

    python benchmarks/soak.py --steps 3000

It prints, per rank, RSS after warm-up, at the end, and the growth per 1000 steps.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

import lockstep


def rss_mib() -> float:
    """This process's resident memory, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(rank: int, steps: int, warmup: int, every: int, directory: str) -> dict:
    lockstep.init_distributed()
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 8))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = lockstep.Checkpointer(directory, keep=2)
    watchdog = lockstep.CollectiveWatchdog(timeout=60)
    torch.manual_seed(rank)
    samples: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            watchdog.all_reduce(loss.detach())
            samples.append((step, rss_mib()))
        if step % every == 0:
            ckpt.save(step, model=model, optimizer=optimizer)
    elapsed = time.perf_counter() - start
    after_warmup = [mib for step, mib in samples if step >= warmup]
    return {
        "rank": rank,
        "warm": after_warmup[0],
        "end": after_warmup[-1],
        "peak": max(after_warmup),
        "per_1000": (after_warmup[-1] - after_warmup[0]) / max(steps - warmup, 1) * 1000,
        "steps_per_s": steps / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500, help="steps before RSS counts")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    with tempfile.TemporaryDirectory() as directory:
        results = lockstep.spawn(
            soak, 2, (args.steps, args.warmup, args.checkpoint_every, directory), timeout=3600
        )
    print(f"soak: {args.steps} steps at world 2, checkpoint every {args.checkpoint_every}, "
          f"a watched all-reduce every 50; RSS from step {args.warmup}")
    print("| rank | RSS after warm-up (MiB) | RSS at end (MiB) | peak (MiB) "
          "| growth per 1000 steps (MiB) | steps/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rank']} | {r['warm']:.1f} | {r['end']:.1f} | {r['peak']:.1f} | "
              f"{r['per_1000']:+.2f} | {r['steps_per_s']:.0f} |")


if __name__ == "__main__":
    main()
