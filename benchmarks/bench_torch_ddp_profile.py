"""What observing torch's own DDP costs (lockstep doctor on Trainer/Lightning scripts): on vs off.

Usage::

    python benchmarks/bench_torch_ddp_profile.py                # world 2, gloo/CPU
    python benchmarks/bench_torch_ddp_profile.py --breakdown    # + microseconds per hook kind
    python benchmarks/bench_torch_ddp_profile.py --quick
    python benchmarks/bench_torch_ddp_profile.py --device cuda --world 1 --width 4096 --batch 256

Each rank builds four :class:`torch.nn.parallel.DistributedDataParallel` replicas of the same
model (a 9-layer MLP, 512 wide unless ``--width``, ``bucket_cap_mb=1``; on CUDA, NCCL and one GPU
per rank, each step synchronised before it is timed):

- ``off``: not observed, torch's built-in (C++) all-reduce;
- ``py-hook``: not observed, torch's Python ``allreduce_hook`` registered: the floor for any
  observer of buckets, since a Python comm hook alone already costs something on CPU;
- ``after``: observed by :class:`lockstep.doctor.torch_ddp.TorchDDPWatch`, whose comm hook
  launches the default all-reduce itself with one future callback per bucket;
- ``before``: observed, with ``allreduce_hook`` registered after the first forward, so the
  observer chains it as it chains any script's hook (and as it chained the default before
  issue #28): a wrapped hook and two future callbacks per bucket.

Blocks of steps alternate between them (the order reverses every round); each step is timed.
The table gives each variant's median step, its ratio to ``off``, the ratio of the fastest
quarters (``p25``: the steps least disturbed by other processes on a shared machine) and the
median over rounds of the ratio of block medians.

``--breakdown`` times, in the same alternation, every callback the observers register with
torch, by kind (the comm hook, forward hooks, the backward start/end marks, the grad-ready
hooks, the optimizer step hooks), in microseconds per step: wrapping every hook costs time of
its own, so its wall times are not the overhead figures (run without it for those). Future
callbacks (the comm hook's completion stamps) run on gloo's thread and are not in the breakdown.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
import lockstep.doctor.optimizer_watch
import lockstep.doctor.torch_ddp
from lockstep.doctor.torch_ddp import TorchDDPWatch

VARIANTS = ("off", "py-hook", "after", "before")
KINDS = ("comm hook", "forward hooks", "backward start/end", "grad-ready hooks", "optimizer hooks")


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)],
                         nn.Linear(width, 10))


class HookTimes:
    """Seconds spent in the hooks registered while :meth:`installed`, by variant and kind."""

    def __init__(self) -> None:
        self.variant = ""
        self.seconds: collections.Counter[tuple[str, str]] = collections.Counter()

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # torch reads a comm hook's signature (through __wrapped__)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.variant, kind] += time.perf_counter() - start
        return timed

    def _registrar(self, kind: str, register: Callable[..., Any], hook_at: int) -> Callable[..., Any]:
        """``register`` with the hook (positional argument ``hook_at``) wrapped in a timer."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            args = (*args[:hook_at], self._timed(kind, args[hook_at]), *args[hook_at + 1:])
            return register(*args, **kwargs)
        return wrapped

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap every hook registered through torch's public registration functions."""
        rec_mod, ddp_mod = lockstep.doctor.optimizer_watch, lockstep.doctor.torch_ddp
        patches = [  # (owner, name, kind, index of the hook among the positional arguments)
            (nn.Module, "register_forward_pre_hook", "forward hooks", 1),
            (nn.Module, "register_forward_hook", "forward hooks", 1),
            (torch.Tensor, "register_hook", "backward start/end", 1),
            (torch.Tensor, "register_post_accumulate_grad_hook", "grad-ready hooks", 1),
            (TorchDDP, "register_comm_hook", "comm hook", 2),
            (rec_mod, "register_optimizer_step_pre_hook", "optimizer hooks", 0),
            (rec_mod, "register_optimizer_step_post_hook", "optimizer hooks", 0),
            (ddp_mod, "queue_callback", "backward start/end", 0),  # backward's end mark
        ]
        with contextlib.ExitStack() as stack:
            for owner, name, kind, at in patches:
                original = getattr(owner, name)
                stack.enter_context(mock.patch.object(owner, name,
                                                      self._registrar(kind, original, at)))
            yield


def run(rank: int, rounds: int, block: int, warmup: int, breakdown: bool, shape: tuple[str, int, int]) -> dict:
    device = torch.device(shape[0], rank) if shape[0] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    times = HookTimes()
    with times.installed() if breakdown else contextlib.nullcontext():
        return _measure(rounds, block, warmup, times, device, shape[1], shape[2])


def _measure(rounds: int, block: int, warmup: int, hook_times: HookTimes, device: torch.device,
             width: int, batch: int) -> dict:
    x, y = torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    models = {name: TorchDDP(_model(width).to(device), bucket_cap_mb=1) for name in VARIANTS}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    models["py-hook"].register_comm_hook(dist.group.WORLD, allreduce_hook)
    watch = TorchDDPWatch({"out_dir": None, "max_steps": None, "warmup": 0, "gather_every": 0})
    for name in ("after", "before"):  # each found at its first forward
        nn.functional.cross_entropy(models[name](x), y).backward()
        opts[name].zero_grad()
    watch.stop_discovery()
    models["before"].register_comm_hook(dist.group.WORLD, allreduce_hook)  # chained

    def steps(name: str, n: int) -> list[float]:
        model, opt = models[name], opts[name]
        hook_times.variant = name
        dist.barrier()
        out = []
        for _ in range(n):
            start = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sync()
            out.append(time.perf_counter() - start)
        return out

    for name in VARIANTS:
        steps(name, warmup)
    hook_times.seconds.clear()
    per_round: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            per_round[name].append(steps(name, block))
    assert [o.ddp for o in watch.observers] == [models["after"], models["before"]]
    assert all(o.buckets_observed and o.recorder.step_count > 0 for o in watch.observers)
    watch.close()
    dist.destroy_process_group()
    n = rounds * block
    return {"per_round": per_round,
            "hooks_us": {f"{v}/{k}": s / n * 1e6 for (v, k), s in hook_times.seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--width", type=int, default=512, help="the MLP's width")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each kind of hook (microseconds per step)")
    parser.add_argument("--quick", action="store_true", help="a few rounds: proves it runs")
    args = parser.parse_args()
    rounds, block = (4, 5) if args.quick else (args.rounds, args.block)
    shape = (args.device, args.width, args.batch)
    res = lockstep.spawn(run, args.world, (rounds, block, 5, args.breakdown, shape), timeout=900)[0]
    per_round = res["per_round"]
    steps = {k: [t for block_times in v for t in block_times] for k, v in per_round.items()}
    med = {k: statistics.median(v) for k, v in steps.items()}
    p25 = {k: statistics.quantiles(v, n=4)[0] for k, v in steps.items()}
    by_round = {k: [statistics.median(b) for b in v] for k, v in per_round.items()}
    where = "NCCL/" + torch.cuda.get_device_name(0) if args.device == "cuda" else "gloo/CPU"
    print(f"world {args.world}, {where}, width {args.width}, batch {args.batch}, {rounds} alternating rounds of {block} steps, rank 0"
          + (" (hooks timed: wall times inflated)" if args.breakdown else "") + ":")
    print(f"  {'variant':10} {'ms/step':>8} {'/ off':>7} {'p25 / off':>10} {'per-round / off':>16}")
    for name in VARIANTS:
        rounds_ratio = statistics.median(a / b for a, b in zip(by_round[name], by_round["off"]))
        print(f"  {name:10} {med[name] * 1e3:8.2f} {med[name] / med['off']:7.3f}"
              f" {p25[name] / p25['off']:10.3f} {rounds_ratio:16.3f}")
    print(f"  after / py-hook: {med['after'] / med['py-hook']:.3f}   "
          f"before / py-hook: {med['before'] / med['py-hook']:.3f}")
    if args.breakdown:
        hooks = res["hooks_us"]
        print("  microseconds per step inside each kind of callback:")
        print(f"  {'kind':20}" + "".join(f"{v:>10}" for v in VARIANTS))
        for kind in KINDS:
            print(f"  {kind:20}" + "".join(f"{hooks.get(f'{v}/{kind}', 0.0):10.0f}"
                                           for v in VARIANTS))


if __name__ == "__main__":
    main()
