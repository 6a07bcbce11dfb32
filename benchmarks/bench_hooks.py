"""Bytes sent per step and validation loss of each comm hook, side by side in one run.

Usage::

    python benchmarks/bench_hooks.py                        # world 2 on CPU, the demo's GPT
    python benchmarks/bench_hooks.py --steps 300 --n-embd 256
    python benchmarks/bench_hooks.py --methods allreduce powersgd --widths 128 384 768

Every method trains the demo's character-level GPT (``examples/chargpt.py``) from the same
initial weights on the same batches for the same number of steps, then evaluates the same
held-out validation blocks: plain all-reduce (the baseline), fp16 and bf16 compression,
PowerSGD (rank r, error feedback, warm start, plain steps first), local SGD and DiLoCo (a merge
every H steps, DiLoCo through an outer Nesterov step). Bytes are the payloads this rank hands to
collectives (:class:`lockstep.comm.ByteCounter`); PowerSGD's are also shown after its plain
warm-up steps ("steady"). A second table measures PowerSGD's steady bytes at several model
widths, since its ratio grows with the matrices. Times on a shared CPU are noisy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lockstep
from lockstep.comm import (
    ByteCounter,
    CommState,
    LocalSGD,
    PowerSGDState,
    bf16_compress_hook,
    fp16_compress_hook,
    powersgd_hook,
    uncompressed_hook,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from chargpt import GPT, BlockDataset, GPTConfig, Vocab, load_corpus

METHODS = ("allreduce", "fp16", "bf16", "powersgd", "local_sgd", "diloco")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--world", type=int, default=2, help="processes (gloo on CPU)")
    add("--steps", type=int, default=250, help="optimizer steps per method")
    add("--seeds", type=int, default=2, help="runs per method (initial weights, batch order)")
    add("--batch-size", type=int, default=8, help="sequences per step on each rank")
    add("--block-size", type=int, default=64)
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--lr", type=float, default=3e-3)
    add("--rank", type=int, default=4, help="PowerSGD's matrix approximation rank")
    add("--powersgd-start", type=int, default=15, help="plain all-reduce steps before PowerSGD")
    add("--sync-every", type=int, default=8, help="H for local SGD and DiLoCo")
    add("--max-files", type=int, default=80, help="stdlib files to read")
    add("--eval-blocks", type=int, default=64)
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--widths", nargs="*", type=int, default=[128, 256, 384, 768],
        help="n_embd values for the PowerSGD bytes table (none to skip)")
    add("--timeout", type=float, default=1800.0, help="seconds per method before giving up")
    return parser.parse_args(argv)


def _data(args: argparse.Namespace) -> tuple[BlockDataset, torch.Tensor, int]:
    vocab = Vocab()
    corpus = load_corpus(args.max_files)
    train = BlockDataset(vocab.encode(corpus.train_text()), args.block_size)
    val = BlockDataset(vocab.encode(corpus.val_text()), args.block_size)
    val_x = torch.stack([val[i][0] for i in range(min(args.eval_blocks, len(val)))])
    val_y = torch.stack([val[i][1] for i in range(min(args.eval_blocks, len(val)))])
    return train, torch.stack([val_x, val_y]), len(vocab)


def _setup(method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           args: argparse.Namespace) -> tuple[ByteCounter, LocalSGD | None]:
    """Register the method's hook (or wrap for local SGD); return its byte counter."""
    hooks = {"allreduce": uncompressed_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
    if method in hooks:
        state = CommState()
        model.register_comm_hook(state, hooks[method])
        return state.counter, None
    if method == "powersgd":
        state = PowerSGDState(matrix_approximation_rank=args.rank,
                              start_powersgd_iter=args.powersgd_start)
        model.register_comm_hook(state, powersgd_hook)
        return state.counter, None
    outer = None
    if method == "diloco":
        def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    local = LocalSGD(model, optimizer, sync_every=args.sync_every, outer_optimizer=outer)
    return local.counter, local


def _train(rank: int, method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    info = lockstep.init_distributed()
    train, val, vocab_size = _data(args)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = lockstep.DistributedDataParallel(GPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    counter, local = _setup(method, model, optimizer, args)
    # The same batches for every method; another seed, another order.
    batches = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
    steady_from, start = 0, time.perf_counter()
    for step in range(args.steps):
        if method == "powersgd" and step == args.powersgd_start:
            steady_from = counter.bytes_sent
        index = torch.randint(len(train), (args.batch_size,), generator=batches).tolist()
        x = torch.stack([train[i][0] for i in index])
        y = torch.stack([train[i][1] for i in index])
        loss = F.cross_entropy(model(x).transpose(1, 2), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        local.step() if local is not None else optimizer.step()
        warmup.step()
    seconds = (time.perf_counter() - start) / args.steps
    model.eval()
    with torch.no_grad():
        val_loss = F.cross_entropy(model(val[0]).transpose(1, 2), val[1]).item()
    steady_steps = args.steps - (args.powersgd_start if method == "powersgd" else 0)
    return {
        "bytes_per_step": counter.bytes_per_step(),
        "steady_bytes_per_step": (counter.bytes_sent - steady_from) / steady_steps,
        "val_loss": val_loss, "train_loss": loss.item(), "seconds_per_step": seconds,
        "world": info.world_size,
    }


def _powersgd_bytes(rank: int, widths: list[int], args: argparse.Namespace) -> dict[int, float]:
    """PowerSGD's steady bytes per step at several widths: three tiny steps each."""
    lockstep.init_distributed()
    out = {}
    for width in widths:
        torch.manual_seed(0)
        cfg = GPTConfig(99, 16, args.n_layer, args.n_head, width)
        model = lockstep.DistributedDataParallel(GPT(cfg))
        state = PowerSGDState(matrix_approximation_rank=args.rank, start_powersgd_iter=2)
        model.register_comm_hook(state, powersgd_hook)
        x = torch.randint(99, (1, 16), generator=torch.Generator().manual_seed(rank))
        plain = 0.0
        for step in range(3):
            if step == 2:
                plain = state.counter.bytes_sent / 2
                state.counter.reset()
            model(x).square().mean().backward()
        out[width] = {"plain": plain, "powersgd": state.counter.bytes_per_step(),
                      "params": sum(p.numel() for p in model.parameters())}
    return out


def _print_methods(results: dict[str, dict], args: argparse.Namespace) -> None:
    base = results.get("allreduce")
    print(f"\n## Comm hooks: demo GPT (n_layer={args.n_layer}, n_embd={args.n_embd}), world "
          f"{args.world}, {args.steps} steps of {args.batch_size}x{args.block_size} tokens/rank, "
          f"val loss: mean of {args.seeds} seeds\n")
    print("| method | bytes/step | steady bytes/step | bytes ratio | val loss (per seed) "
          "| loss vs plain | s/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method, r in results.items():
        ratio = "-"
        if base:
            ratio = f"{base['steady_bytes_per_step'] / r['steady_bytes_per_step']:.1f}x"
        delta = f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}%" if base else "-"
        seeds = ", ".join(f"{v:.3f}" for v in r["val_losses"])
        print(f"| {_label(method, args)} | {r['bytes_per_step']:,.0f} | "
              f"{r['steady_bytes_per_step']:,.0f} | {ratio} | {r['val_loss']:.4f} ({seeds}) | "
              f"{delta} | {r['seconds_per_step']:.3f} |")


def _label(method: str, args: argparse.Namespace) -> str:
    if method == "powersgd":
        return f"powersgd rank {args.rank} (plain for {args.powersgd_start} steps)"
    if method in ("local_sgd", "diloco"):
        return f"{method} H={args.sync_every}"
    return method


def _print_widths(widths: dict[int, dict], args: argparse.Namespace) -> None:
    print(f"\n## PowerSGD rank {args.rank}: steady bytes per step by model width "
          f"(n_layer={args.n_layer})\n")
    print("| n_embd | parameters | plain all-reduce bytes | PowerSGD bytes | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for width, r in widths.items():
        print(f"| {width} | {r['params']:,} | {r['plain']:,.0f} | {r['powersgd']:,.0f} | "
              f"{r['plain'] / r['powersgd']:.1f}x |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {}
    for method in args.methods:
        runs = []
        for seed in range(args.seeds):
            run = lockstep.spawn(
                _train, args.world, args=(method, seed, args), timeout=args.timeout
            )
            runs.append(run[0])
            print(f"{method} seed {seed}: {run[0]}", flush=True)
        keys = ("bytes_per_step", "steady_bytes_per_step", "val_loss", "seconds_per_step")
        results[method] = {key: sum(float(r[key]) for r in runs) / len(runs) for key in keys}
        results[method]["val_losses"] = [float(r["val_loss"]) for r in runs]
    _print_methods(results, args)
    if args.widths:
        widths = lockstep.spawn(_powersgd_bytes, args.world, args=(args.widths, args),
                                timeout=args.timeout)[0]
        _print_widths(widths, args)


if __name__ == "__main__":
    main()
