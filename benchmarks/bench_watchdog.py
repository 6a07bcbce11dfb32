"""What watching a collective costs: plain all-reduce vs CollectiveWatchdog vs its debug mode.

World 2 on gloo (CPU), side by side in one run::

    python benchmarks/bench_watchdog.py --iters 300

Prints microseconds per all-reduce for a small (1 KiB) and a larger (4 MiB) tensor and the
ratio to the plain call. The three variants alternate over several rounds and the median round
is reported, so a burst of load on the shared machine does not land on one variant only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lockstep

SIZES = {"1 KiB": 256, "4 MiB": 1 << 20}
ROUNDS = 5


def _time(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def measure(rank: int, iters: int) -> dict:
    lockstep.init_distributed()
    watched = lockstep.CollectiveWatchdog(timeout=60, debug=False, name="plain")
    checked = lockstep.CollectiveWatchdog(timeout=60, debug=True, name="debug")
    out = {}
    for label, numel in SIZES.items():
        t = torch.ones(numel)
        calls = {
            "torch.distributed.all_reduce": lambda t=t: dist.all_reduce(t),
            "CollectiveWatchdog.all_reduce": lambda t=t: watched.all_reduce(t),
            "… with LOCKSTEP_DEBUG_COLLECTIVES=1": lambda t=t: checked.all_reduce(t),
        }
        rounds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                rounds[name].append(_time(call, max(iters // ROUNDS, 1)))
        out[label] = {name: statistics.median(times) for name, times in rounds.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    result = lockstep.spawn(measure, 2, (args.iters,), timeout=600)[0]
    print(f"world 2, gloo on CPU, {args.iters} all-reduces each (rank 0's timings)")
    print("| tensor | call | µs per all-reduce | ratio to plain |")
    print("|---|---|---|---|")
    for label, timings in result.items():
        base = timings["torch.distributed.all_reduce"]
        for call, us in timings.items():
            print(f"| {label} | {call} | {us:.0f} | {us / base:.2f}x |")


if __name__ == "__main__":
    main()
