"""Memory, traffic and step time per rank: DDP, ZeRO-1, ZeRO-2 and full sharding, in one run.

Usage::

    python benchmarks/bench_fsdp.py                  # CPU, gloo, worlds 2 and 3, AdamW, fp32
    python benchmarks/bench_fsdp.py --worlds 2 --steps 5 --layers 8

For each world size one set of processes trains the same transformer (bench_zero's TinyGPT)
four ways: ``ddp`` (lockstep.DistributedDataParallel), ``zero1`` (DDP +
ZeroRedundancyOptimizer), ``zero2`` (ZeroRedundancyOptimizer(reduce_gradients=True)) and
``fsdp`` (lockstep.fully_shard per block, then the root; ``fsdp_no_prefetch`` the same with
prefetching off). For the heaviest rank it reports the
bytes of parameters, gradients and optimizer state held after a step, against the ZeRO paper's
formulas written for fp32 AdamW (4 bytes of parameter, 4 of gradient, 8 of state per element:
DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, full sharding 16Ψ/N; the paper's mixed-precision
split 2 + 2 + 12 gives the same 16Ψ and 16Ψ/N), the most parameter bytes full sharding held
gathered at once, the bytes each rank puts on the wire per step (ring cost model), and the
median step time. Times on a shared CPU are noisy: read their ratios only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.fsdp import set_prefetch
from lockstep.fsdp.unit import get_unit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import TinyGPT

# collective -> (index of the argument whose size S prices it, ring factor (N-1)/N × this)
_PRICED = {
    "all_reduce": (0, 2),
    "broadcast": (0, 1),
    "reduce": (0, 1),
    "all_gather": (0, 1),
    "all_gather_single": (0, 1),
    "all_gather_into_tensor": (0, 1),
    "reduce_scatter_single": (1, 1),
    "reduce_scatter_tensor": (1, 1),
    "reduce_scatter": (1, 1),
}
VARIANTS = ("ddp", "zero1", "zero2", "fsdp", "fsdp_no_prefetch")
FORMULA = {  # bytes per element of the model, for world N (fp32 AdamW)
    "ddp": lambda n: 16.0,
    "zero1": lambda n: 8 + 8 / n,
    "zero2": lambda n: 4 + 12 / n,
    "fsdp": lambda n: 16 / n,
    "fsdp_no_prefetch": lambda n: 16 / n,
}


@contextlib.contextmanager
def count_wire_bytes(totals: list[float], world: int) -> Iterator[None]:
    """Add the ring-model bytes of every collective this process starts (benchmark-only probe)."""
    originals = {n: getattr(dist, n) for n in _PRICED if hasattr(dist, n)}

    def counting(name: str, fn: Callable) -> Callable:
        index, factor = _PRICED[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            arg = args[index]
            tensors = arg if isinstance(arg, (list, tuple)) else [arg]
            size = sum(t.numel() * t.element_size() for t in tensors)
            totals[0] += size * factor * (world - 1) / world
            return fn(*args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _build(variant: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(args.vocab, args.dim, args.layers)
    psi = sum(p.numel() for p in model.parameters())
    kwargs: dict[str, Any] = {"lr": 1e-3}
    gathered = [0]
    if variant == "ddp":
        model = lockstep.DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **kwargs), [psi, 0]
    if variant == "zero1":
        model = lockstep.DistributedDataParallel(model)
        return model, lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kwargs), [psi, 0]
    if variant == "zero2":
        opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, reduce_gradients=True, **kwargs)
        return model, opt, [psi, 0]
    units: list[nn.Module] = [*model.blocks.layers, model]  # type: ignore[union-attr, misc]
    for unit in units:
        lockstep.fully_shard(unit, reshard_after_forward=True)  # ZeRO-3 traffic (the figures in docs/fsdp.md)
    set_prefetch(model, variant == "fsdp")

    def sample(*_: Any) -> None:  # after a unit gathered: what is gathered now, all units
        live = 0
        for module in units:
            unit = get_unit(module)
            assert unit is not None
            live += unit.gathered_bytes()
        gathered[0] = max(gathered[0], live)

    for unit in units:
        unit.register_forward_pre_hook(sample)  # runs after fully_shard's own pre-hook
    return model, torch.optim.AdamW(model.parameters(), **kwargs), [psi, 0, gathered]  # type: ignore[list-item]


def _run(variant: str, args: argparse.Namespace, rank: int) -> dict:
    model, opt, info = _build(variant, args)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(args.vocab, (args.batch, 33), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()

    step()  # warm-up: creates the optimizer state
    wire = [0.0]
    times = []
    with count_wire_bytes(wire, dist.get_world_size()):
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    params = list(model.parameters())
    state = [v for s in getattr(opt, "optim", opt).state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "psi": info[0],
        "params": _bytes(params),
        "grads": _bytes([p.grad for p in params if p.grad is not None]),
        "state": _bytes(state),
        "gathered": info[2][0] if len(info) > 2 else 0,  # type: ignore[index]
        "wire": wire[0] / args.steps,
        "step_s": statistics.median(times),
    }


def worker(rank: int, args: argparse.Namespace) -> dict[str, dict]:
    lockstep.init_distributed(device="cpu")
    torch.set_num_threads(1)
    return {v: _run(v, args, rank) for v in VARIANTS}


def _report(world: int, results: list[dict[str, dict]]) -> None:
    worst = {v: {k: max(r[v][k] for r in results) for k in results[0][v]} for v in VARIANTS}
    psi = worst["ddp"]["psi"]
    mib = 2**20
    print(f"\n### world {world} (heaviest rank; Ψ = {psi / 1e6:.2f} M parameters, {4 * psi / mib:.1f} MiB fp32)\n")
    print("| variant | params | grads | optimizer | total | formula | total / formula "
          "| most gathered | wire per step | wire / Ψ·4 B | step ms | vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v, m in worst.items():
        total = m["params"] + m["grads"] + m["state"]
        formula = FORMULA[v](world) * psi
        print(
            f"| {v} | {m['params'] / mib:.2f} MiB | {m['grads'] / mib:.2f} MiB | {m['state'] / mib:.2f} MiB "
            f"| {total / mib:.2f} MiB | {formula / mib:.2f} MiB | {total / formula:.3f} "
            f"| {m['gathered'] / mib:.2f} MiB | {m['wire'] / mib:.2f} MiB | {m['wire'] / (4 * psi):.2f} "
            f"| {m['step_s'] * 1e3:.0f} | {m['step_s'] / worst['ddp']['step_s']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    for world in args.worlds:
        _report(world, lockstep.spawn(worker, world, args=(args,), timeout=600))


if __name__ == "__main__":
    main()
