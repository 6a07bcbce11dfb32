"""What profiling costs: lockstep's DDP with ``enable_profiling()`` on vs off, side by side.

Usage::

    python benchmarks/bench_profile.py            # world 2, gloo/CPU, the DDP benchmark models
    python benchmarks/bench_profile.py --quick

Both variants run in the same processes on the same model: blocks of steps alternate between
profiling off and on (the order flips every round), and the table reports the median step time of
each over every block, and their ratio. The models and batches are those of bench_ddp.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from bench_ddp import MODELS, loss_of, make_batch

import lockstep

BATCH = {"mlp": 32, "transformer": 16, "convnet": 32}


def run(rank: int, model_name: str, rounds: int, block: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    info = lockstep.init_distributed()
    build, kind = MODELS[model_name]
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(build().to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch(kind, BATCH[model_name], info.device)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(kind, model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):
            model.enable_profiling(variant == "on", warmup=0)
            step()  # the first step after a switch starts the new recorder's step
            times[variant].extend(step() for _ in range(block))
    model.enable_profiling(False)
    dist.barrier()
    return {v: statistics.median(t) for v, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 steps")
    args = parser.parse_args()
    rounds, block = (3, 5) if args.quick else (args.rounds, args.block)
    print(f"world {args.world}, gloo on CPU, one thread per rank; {rounds} rounds x {block} "
          "steps per variant, medians (mean over ranks)\n")
    print("| model | step, profiling off (ms) | step, profiling on (ms) | on / off |")
    print("|---|---|---|---|")
    for name in args.models:
        results = lockstep.spawn(run, args.world, (name, rounds, block, 3), timeout=900)
        off = statistics.fmean(r["off"] for r in results)
        on = statistics.fmean(r["on"] for r in results)
        print(f"| {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} |", flush=True)


if __name__ == "__main__":
    main()
