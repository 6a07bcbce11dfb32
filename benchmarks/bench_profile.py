"""What profiling costs: lockstep's DDP with ``enable_profiling()`` on vs off, side by side.

Usage::

    python benchmarks/bench_profile.py            # world 2, gloo/CPU, the DDP benchmark models
    python benchmarks/bench_profile.py --quick

Both variants run in the same processes on the same model: blocks of steps alternate between
profiling off and on (the order flips every round), and the table reports the median wall time and
CPU time (this process, all threads) per step of each, and their ratios. The models and batches
are those of bench_ddp.py. A second table times the recorder's own calls for one step in a loop,
which a busy machine disturbs far less than a step of training.
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

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss_of(kind, model(x), y).backward()
        opt.step()
        return time.perf_counter() - start, time.process_time() - cpu

    for _ in range(warmup):
        step()
    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for r in range(rounds):
        for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):
            model.enable_profiling(variant == "on", warmup=0)
            step()  # the first step after a switch starts the new recorder's step
            times[variant].extend(step() for _ in range(block))
    model.enable_profiling(False)
    dist.barrier()
    return {f"{v}_{what}": statistics.median(t[i] for t in ts)
            for v, ts in times.items() for i, what in enumerate(("wall", "cpu"))}


def recorder_cost(buckets: int, steps: int = 3000) -> float:
    """CPU seconds per step of the recorder's calls alone (``buckets`` buckets), by difference.

    CPU time of this process, not wall time: other processes on a shared machine barely move it.
    """
    from lockstep.doctor.recorder import Recorder

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)
    x = torch.zeros(4, 4)

    def loop(rec: Recorder | None) -> float:
        start = time.process_time()
        for _ in range(steps):
            if rec is not None:
                rec.forward_started((x,))
                rec.forward_synced()
                rec.forward_ended()
                rec.backward_started()
                for b in range(buckets):
                    rec.bucket_ready(b, "w")
                    rec.bucket_launched(b)
                    rec.watch_bucket(b, done)
                rec.backward_compute_ended()
                for b in range(buckets):
                    rec.bucket_waited(b)
                rec.backward_ended()
            opt.step()
        return (time.process_time() - start) / steps

    off_times, on_times = [], []
    for _ in range(5):  # interleaved, the minimum of each; no recorder (or hook) while off
        off_times.append(loop(None))
        rec = Recorder(torch.device("cpu"), [param], warmup=0)
        on_times.append(loop(rec))
        rec.close()
    return min(on_times) - min(off_times)


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
    print("| model | wall off (ms) | wall on (ms) | wall on/off | CPU off (ms) | CPU on (ms) "
          "| CPU on/off |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        results = lockstep.spawn(run, args.world, (name, rounds, block, 3), timeout=900)
        m = {k: statistics.fmean(r[k] for r in results) * 1e3 for k in results[0]}
        print(f"| {name} | {m['off_wall']:.2f} | {m['on_wall']:.2f} | "
              f"{m['on_wall'] / m['off_wall']:.3f} | {m['off_cpu']:.2f} | {m['on_cpu']:.2f} | "
              f"{m['on_cpu'] / m['off_cpu']:.3f} |", flush=True)
    torch.set_num_threads(1)
    print("\n| buckets per step | recorder cost per step (us) |\n|---|---|")
    for buckets in (1, 4, 16):
        print(f"| {buckets} | {recorder_cost(buckets) * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
