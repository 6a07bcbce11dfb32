"""Where a world-2 step's time goes that a world-1 profile does not show (docs/plan.md, Validation).

Usage::

    python benchmarks/bench_plan_gap.py                         # convnet, 3-step blocks, 60 blocks
    python benchmarks/bench_plan_gap.py --model mlp --blocks 30

At worlds 1 and 2 (gloo on CPU, one thread per rank) the same model trains under four DDP
settings, interleaved in short blocks so that a change in the machine's load hits all four:
buffer broadcast and all-reduce (DDP's default), all-reduce only (``broadcast_buffers=False``),
broadcast only and neither (a comm hook that sends nothing). For each it prints the step's wall
time (the slowest rank's; low percentiles approximate an unloaded machine), the main thread's CPU
time (the compute itself: it grows if the ranks slow each other's kernels) and the process's CPU
time (plus gloo's threads). At world 2 it also times the buffer broadcast alone
(``sync_module_buffers``, what ``lockstep plan`` prices as one broadcast per buffer message).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ddp

import lockstep

BATCH = 32
CONFIGS = {  # name: (broadcast_buffers, all-reduce gradients)
    "bcast + all-reduce": (True, True),
    "all-reduce only": (False, True),
    "bcast only": (True, False),
    "no communication": (False, False),
}


def _worker(rank: int, model_name: str, block: int, blocks: int) -> dict:
    import torch.distributed as dist

    from lockstep.comm.local_sgd import local_gradients_hook

    info = lockstep.init_distributed()
    build, kind = bench_ddp.MODELS[model_name]
    x, y = bench_ddp.make_batch(kind, BATCH, torch.device("cpu"))
    runs = {}
    for name, (broadcast, reduce) in CONFIGS.items():
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(build(), broadcast_buffers=broadcast)
        if not reduce and info.world_size > 1:
            model.register_comm_hook(None, local_gradients_hook)
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    out: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    bcast: list[float] = []
    for _ in range(blocks):
        for name, (model, opt) in runs.items():
            opt.zero_grad()
            bench_ddp.loss_of(kind, model(x), y).backward()  # one unmeasured step per block
            opt.step()
            dist.barrier()
            for _ in range(block):
                wall, thread, proc = time.perf_counter(), time.thread_time(), time.process_time()
                opt.zero_grad()
                bench_ddp.loss_of(kind, model(x), y).backward()
                opt.step()
                out[name].append((time.perf_counter() - wall, time.thread_time() - thread,
                                  time.process_time() - proc))
        if info.world_size > 1:
            model = runs["bcast + all-reduce"][0]
            dist.barrier()
            for _ in range(5):
                start = time.perf_counter()
                model.sync_module_buffers(0)
                bcast.append(time.perf_counter() - start)
    return {"steps": out, "bcast": bcast}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="convnet", choices=sorted(bench_ddp.MODELS))
    parser.add_argument("--block", type=int, default=3, help="steps per setting in a row")
    parser.add_argument("--blocks", type=int, default=60, help="rounds over the four settings")
    args = parser.parse_args()
    print(f"{args.model}, batch {BATCH} per rank; ms per step: wall p10 / p25 / median (slowest "
          "rank), CPU medians (mean over ranks)")
    print("\n| world | setting | wall p10 | wall p25 | wall median | main-thread CPU | process CPU |")
    print("|---|---|---|---|---|---|---|")
    for world in (1, 2):
        got = lockstep.spawn(_worker, world, (args.model, args.block, args.blocks), timeout=1800)
        for name in CONFIGS:
            n = len(got[0]["steps"][name])
            wall = [max(g["steps"][name][i][0] for g in got) for i in range(n)]
            thread = [statistics.fmean(g["steps"][name][i][1] for g in got) for i in range(n)]
            proc = [statistics.fmean(g["steps"][name][i][2] for g in got) for i in range(n)]
            print(f"| {world} | {name} | {_pct(wall, .1):.1f} | {_pct(wall, .25):.1f} "
                  f"| {_pct(wall, .5):.1f} | {_pct(thread, .5):.1f} | {_pct(proc, .5):.1f} |",
                  flush=True)
        if world > 1:
            b = [max(g["bcast"][i] for g in got) for i in range(len(got[0]["bcast"]))]
            print(f"\nbuffer broadcast alone at world 2 (sync_module_buffers, {len(b)} calls): "
                  f"p10 {_pct(b, .1):.2f} ms, p25 {_pct(b, .25):.2f} ms, median {_pct(b, .5):.2f} ms")


if __name__ == "__main__":
    main()
