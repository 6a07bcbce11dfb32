"""What an atomic, checksummed checkpoint costs next to a bare ``torch.save``.

One process, a model of about ``--mib`` MiB of float32 weights plus Adam's state (3x that)::

    python benchmarks/bench_checkpoint.py --mib 64

Prints seconds to save and to resume (read, then load into the model and optimizer) with each,
and the ratios. ``torch.save`` neither fsyncs nor checksums: that is the difference measured.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import lockstep


def build(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # materialise Adam's moments
    return model, optimizer


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, optimizer = build(args.mib)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp, "plain.pt")
        ckpt = lockstep.Checkpointer(Path(tmp, "ck"), keep=1)
        def torch_save() -> None:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)

        def torch_load() -> None:
            state = torch.load(plain, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        rows = {
            "torch.save / torch.load(weights_only) + load_state_dict": (
                best_of(torch_save, args.repeats), best_of(torch_load, args.repeats)
            ),
            "Checkpointer.save / restore": (
                best_of(lambda: ckpt.save(1, model=model, optimizer=optimizer), args.repeats),
                best_of(lambda: ckpt.restore(model=model, optimizer=optimizer), args.repeats),
            ),
        }
        size = plain.stat().st_size / 2**20
    print(f"{size:.0f} MiB of model + Adam state, one process, best of {args.repeats}")
    print("| how | save (s) | resume (s) | save ratio | resume ratio |")
    print("|---|---|---|---|---|")
    base_save, base_load = rows["torch.save / torch.load(weights_only) + load_state_dict"]
    for how, (save, load) in rows.items():
        ratios = f"{save / base_save:.2f}x | {load / base_load:.2f}x"
        print(f"| {how} | {save:.3f} | {load:.3f} | {ratios} |")


if __name__ == "__main__":
    main()
