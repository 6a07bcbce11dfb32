"""What observing torch's own DDP costs (lockstep doctor on Trainer/Lightning scripts): on vs off.

Usage::

    python benchmarks/bench_torch_ddp_profile.py            # world 2, gloo/CPU
    python benchmarks/bench_torch_ddp_profile.py --quick

Each rank builds two :class:`torch.nn.parallel.DistributedDataParallel` replicas of the same
model: one observed by :class:`lockstep.doctor.torch_ddp.TorchDDPWatch` (hooks, the wrapping
comm hook, the recorder), one plain (torch's built-in all-reduce), and one with torch's Python ``allreduce_hook`` (the
hook the observer wraps), to separate a Python comm hook's own cost. Blocks of steps alternate
between them (the order reverses every round); the table gives the median wall time per step of
each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import lockstep
from lockstep.doctor.torch_ddp import TorchDDPWatch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)],
                         nn.Linear(512, 10))


def run(rank: int, rounds: int, block: int, warmup: int) -> dict:
    dist.init_process_group("gloo")
    watch = TorchDDPWatch({"out_dir": None, "max_steps": None, "warmup": 0, "gather_every": 0})
    observed = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    opts = {}
    opts["on"] = torch.optim.SGD(observed.parameters(), lr=1e-3)
    nn.functional.cross_entropy(observed(x), y).backward()  # found at its first forward
    watch.stop_discovery()
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1)
    opts["off"] = torch.optim.SGD(plain.parameters(), lr=1e-3)
    # torch's own Python all-reduce hook, unobserved: what a Python comm hook costs by itself
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1)
    hooked.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opts["py-hook"] = torch.optim.SGD(hooked.parameters(), lr=1e-3)
    models = {"on": observed, "off": plain, "py-hook": hooked}

    def steps(name: str, n: int) -> float:
        model, opt = models[name], opts[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / n

    for name in models:
        steps(name, warmup)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = ("on", "off", "py-hook")
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(steps(name, block))
    assert watch.observers and watch.observers[0].recorder.step_count > 0
    watch.close()
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a few rounds: proves it runs")
    args = parser.parse_args()
    rounds, block = (4, 5) if args.quick else (args.rounds, args.block)
    res = lockstep.spawn(run, args.world, (rounds, block, 5), timeout=600)[0]
    print(f"world {args.world}, gloo/CPU, {rounds} rounds of {block} steps, median per step:")
    print(f"  torch DDP, not observed: {res['off'] * 1e3:8.2f} ms")
    print(f"  torch DDP, observed:     {res['on'] * 1e3:8.2f} ms")
    print(f"  torch DDP, Python allreduce_hook, not observed: {res['py-hook'] * 1e3:8.2f} ms")
    print(f"  observed / not:          {res['on'] / res['off']:8.3f}")
    print(f"  observed / Python hook:  {res['on'] / res['py-hook']:8.3f}")


if __name__ == "__main__":
    main()
