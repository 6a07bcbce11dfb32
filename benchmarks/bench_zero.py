"""Memory per rank of plain data parallelism, ZeRO-1 and ZeRO-2, side by side in one run.

Usage::

    python benchmarks/bench_zero.py                   # CPU, gloo, worlds 2 and 3, Adam
    python benchmarks/bench_zero.py --worlds 2 3 4 --steps 5 --optimizer sgd
    python benchmarks/bench_zero.py --device cuda --worlds 2

For each world size, one set of processes trains the same small transformer three ways:
``plain`` (lockstep's DDP + the optimizer), ``zero1`` (DDP + ZeroRedundancyOptimizer) and
``zero2`` (an unwrapped model + ZeroRedundancyOptimizer(reduce_gradients=True)). It reports,
for the heaviest rank: optimizer-state bytes, gradient bytes held after ``step()``, the bytes
it sends per step for gradients and for parameters (the payloads it hands to collectives,
counted exactly, priced by the ring cost model), and the median step time. Times on a shared
CPU are noisy: read their ratios only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.zero.gradients import grad_bytes

_COUNTED = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


class TinyGPT(nn.Module):
    """A small pre-norm transformer: one embedding and a dozen tensors per block."""

    def __init__(self, vocab: int, dim: int, layers: int, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]]))


@contextlib.contextmanager
def count_collective_bytes(totals: dict[str, int]) -> Iterator[None]:
    """Add up the bytes of the tensors this process hands to tensor collectives.

    A benchmark-only probe: it wraps ``torch.distributed``'s functions while active.
    """
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            totals[name] = totals.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
            return fn(tensor, *args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for per_param in opt.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def _build(variant: str, args: argparse.Namespace, device: torch.device) -> tuple:
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(args.vocab, args.dim, args.layers).to(device)
    cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    kwargs: dict[str, Any] = {"lr": 1e-3} if args.optimizer == "adam" else {"lr": 0.1, "momentum": 0.9}
    if variant == "plain":
        model = lockstep.DistributedDataParallel(model)
        return model, cls(model.parameters(), **kwargs)
    if variant == "zero1":
        model = lockstep.DistributedDataParallel(model)
        return model, lockstep.ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), cls, reduce_gradients=True, **kwargs)
    return model, opt


def _run_variant(variant: str, args: argparse.Namespace, device: torch.device, rank: int) -> dict:
    model, opt = _build(variant, args, device)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(args.vocab, (args.batch, 33), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()

    step()  # warm-up: creates the optimizer state
    sent: dict[str, int] = {}
    times = []
    with count_collective_bytes(sent):
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    params = list(model.parameters())
    world = dist.get_world_size()
    return {
        "state": _state_bytes(opt),
        "grads": grad_bytes(params),
        "params": sum(p.numel() * p.element_size() for p in params),
        "grad_traffic": _ring_bytes(sent, ("all_reduce", "reduce", "reduce_scatter"), world, args.steps),
        "param_traffic": _ring_bytes(sent, ("broadcast", "all_gather"), world, args.steps),
        "step_s": statistics.median(times),
    }


def _ring_bytes(sent: dict[str, int], names: tuple[str, ...], world: int, steps: int) -> float:
    """Bytes each rank puts on the wire per step, by the ring cost model.

    An all-reduce of S bytes is a reduce-scatter plus an all-gather: 2(N-1)/N * S per rank;
    a reduce, broadcast, reduce-scatter or all-gather is one of those halves: (N-1)/N * S.
    """
    share = (world - 1) / world
    return sum(sent.get(n, 0) * share * (2 if n == "all_reduce" else 1) for n in names) / steps


def worker(rank: int, args: argparse.Namespace) -> dict[str, dict]:
    # "cuda" lets init_distributed pick GPU number local_rank; "cpu" forces gloo on the CPU.
    info = lockstep.init_distributed(device="cpu" if args.device == "cpu" else None)
    torch.set_num_threads(1)
    return {v: _run_variant(v, args, info.device, rank) for v in ("plain", "zero1", "zero2")}


def _report(world: int, results: list[dict[str, dict]]) -> None:
    heaviest = {v: {k: max(r[v][k] for r in results) for k in results[0][v]} for v in results[0]}
    plain = heaviest["plain"]
    print(f"\n### world {world} (heaviest rank; model {plain['params'] / 2**20:.1f} MiB)\n")
    print("| variant | optimizer state | vs plain | gradients held | vs plain "
          "| gradient traffic | parameter traffic | total vs plain | step ms | vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    plain_traffic = plain["grad_traffic"] + plain["param_traffic"]
    for variant, m in heaviest.items():
        print(
            f"| {variant} | {m['state'] / 2**20:.2f} MiB | {m['state'] / plain['state']:.3f} "
            f"| {m['grads'] / 2**20:.2f} MiB | {m['grads'] / plain['grads']:.3f} "
            f"| {m['grad_traffic'] / 2**20:.2f} MiB | {m['param_traffic'] / 2**20:.2f} MiB "
            f"| {(m['grad_traffic'] + m['param_traffic']) / plain_traffic:.2f} "
            f"| {m['step_s'] * 1e3:.0f} | {m['step_s'] / plain['step_s']:.2f} |"
        )
    target = 1 / world + 0.02
    ratio = heaviest["zero1"]["state"] / plain["state"]
    verdict = "meets" if ratio <= target else "MISSES"
    print(f"\nZeRO state ratio {ratio:.3f} {verdict} the target 1/{world} + 2% = {target:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    for world in args.worlds:
        _report(world, lockstep.spawn(worker, world, args=(args,), timeout=600))


if __name__ == "__main__":
    main()
