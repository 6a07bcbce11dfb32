"""Side-by-side step times: the bare model, torch's DDP and lockstep's DDP.

Usage::

    python benchmarks/bench_ddp.py                 # CPU, gloo, worlds 1 and 2, all models
    python benchmarks/bench_ddp.py --quick         # fewer steps and repetitions
    python benchmarks/bench_ddp.py --device cuda --models transformer100m --worlds 1

Every variant runs in fresh processes (one thread per rank), variants alternate within each
repetition, and the table reports medians over repetitions: these machines are noisy, so read
the ratios, not the absolute times. "exposed" is the share of lockstep's step spent waiting for
communication that backward did not hide.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep


# ---- models --------------------------------------------------------------------------------
def mlp() -> nn.Module:
    """~8.4M parameters in a few large tensors."""
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 1024))


class Transformer(nn.Module):
    """Many small parameters: every layer has a dozen tensors."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(h))


def convnet() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.Flatten(),
                         nn.Linear(128 * 4 * 4, 10))


MODELS = {
    "mlp": (mlp, "vector"),
    "transformer": (lambda: Transformer(256, 128, 6, 4, 64), "tokens"),
    "convnet": (convnet, "image"),
    "transformer100m": (lambda: Transformer(32000, 768, 12, 12, 256), "tokens100m"),
}


def make_batch(kind: str, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "vector":
        x, y = torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)
    elif kind == "image":
        x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    else:
        vocab, context = (256, 64) if kind == "tokens" else (32000, 256)
        x = torch.randint(0, vocab, (batch, context), generator=g)
        y = x.roll(1, dims=1)
    return x.to(device), y.to(device)


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "vector":
        return F.mse_loss(out, y)
    if kind == "image":
        return F.cross_entropy(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


# ---- one measured run (inside fresh processes) -----------------------------------------------
def run_variant(rank: int, model_name: str, variant: str, batch: int, steps: int, warmup: int,
                device_type: str) -> dict:
    torch.set_num_threads(1) if device_type == "cpu" else None
    info = lockstep.init_distributed() if variant != "bare" else None
    device = info.device if info is not None else torch.device(device_type)
    build, kind = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(device)
    if variant == "torch":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif variant == "lockstep":
        model = lockstep.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch(kind, batch, device)

    def step() -> None:
        opt.zero_grad()
        loss_of(kind, model(x), y).backward()
        opt.step()

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    exposed = None
    if variant == "lockstep":
        model.enable_step_timing()
        for _ in range(max(3, steps // 2)):
            step()
        exposed = statistics.median(t.exposed_share for t in model.step_timings)
    if info is not None:
        dist.barrier()
    return {"step_s": statistics.median(times), "exposed": exposed}


def measure(model_name: str, variant: str, world: int, args: argparse.Namespace) -> dict:
    run_args = (model_name, variant, args.batch, args.steps, args.warmup, args.device)
    if variant == "bare":
        # A fresh process too, so every variant starts equally cold.
        results = lockstep.spawn(run_variant, 1, run_args, timeout=args.timeout)
    else:
        results = lockstep.spawn(run_variant, world, run_args, timeout=args.timeout)
    return {"step_s": max(r["step_s"] for r in results), "exposed": results[0]["exposed"]}


# ---- the table -------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer", "convnet"],
                        choices=sorted(MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--quick", action="store_true", help="8 steps, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 8, 3, 2

    rows = []
    for model_name in args.models:
        for world in args.worlds:
            variants = (["bare"] if world == 1 else []) + ["torch", "lockstep"]
            samples: dict[str, list[dict]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                for variant in variants:  # alternate, so drift in machine load hits all alike
                    samples[variant].append(measure(model_name, variant, world, args))
            # Best of the repetitions: on a shared machine a whole process can land on slow
            # memory or a busy core (the same bare model varies by +-20% between processes),
            # while the fastest run of each variant shows what it costs by itself.
            med = {v: min(s["step_s"] for s in samples[v]) for v in variants}
            exposed = statistics.median(s["exposed"] for s in samples["lockstep"])
            rows.append((model_name, world, med.get("bare"), med["torch"], med["lockstep"], exposed))
            print_row(rows[-1], header=len(rows) == 1, device=args.device)


def print_row(row: tuple, header: bool, device: str) -> None:
    if header:
        print(f"\nDDP step time, {device}, per-rank batch; best of the repetitions' medians (ms)")
        print("| model | world | bare | torch DDP | lockstep DDP | lockstep/torch | lockstep/bare | exposed comm |")
        print("|---|---|---|---|---|---|---|---|")
    name, world, bare, tor, lock, exposed = row
    bare_s = f"{bare * 1e3:.1f}" if bare else "-"
    vs_bare = f"{lock / bare:.3f}" if bare else "-"
    print(f"| {name} | {world} | {bare_s} | {tor * 1e3:.1f} | {lock * 1e3:.1f} | {lock / tor:.3f} "
          f"| {vs_bare} | {exposed * 100:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
