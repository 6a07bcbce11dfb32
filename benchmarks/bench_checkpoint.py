"""What an atomic, checksummed checkpoint costs next to a bare ``torch.save``.

One process, a model of about ``--mib`` MiB of float32 weights plus Adam's state (3x that)::

    python benchmarks/bench_checkpoint.py --mib 64
    python benchmarks/bench_checkpoint.py --mib 21 --stall-only    # ~64 MiB of state
    python benchmarks/bench_checkpoint.py --mib 171 --stall-only   # ~512 MiB of state
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --every-step --repeats 3

Prints seconds to save and to resume (read, then load into the model and optimizer) with each,
and the ratios. ``torch.save`` neither fsyncs nor checksums: that is the difference measured.

Then the stall: how long each way of saving blocks the training loop, taken alternately, best
of ``--repeats``: ``torch.save``, a copy of the state in memory (``clone()`` of every tensor),
a blocking ``Checkpointer.save(blocking=True)`` and an asynchronous one (the default; its
background write is waited for outside the timed part, as the next training steps would hide it).
The asynchronous save copies the parameters and Adam's state after it returns, before the next
``optimizer.step()``: the last two rows time a step alone and a save followed at once by a step
(no forward/backward to hide the copy behind), whose difference is the most a step can wait;
the very last row times that wait alone (from the call of ``step()`` to the end of the copy),
which a busy machine's noise in the step itself does not hide.
"""

from __future__ import annotations

import argparse
import statistics
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
    parser.add_argument("--stall-only", action="store_true",
                        help="print only the second table (the stall per save)")
    parser.add_argument("--every-step", action="store_true",
                        help="only the cost of saving every step of a small MLP")
    args = parser.parse_args()
    if args.every_step:
        every_step(args.repeats)
        return
    model, optimizer = build(args.mib)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp, "plain.pt")
        if args.stall_only:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
            size = plain.stat().st_size / 2**20
            stalls = measure_stalls(model, optimizer, Path(tmp), args.repeats, lambda: torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain))
            print_stalls(stalls, size)
            return
        ckpt = lockstep.Checkpointer(Path(tmp, "ck"), keep=1, blocking=True)  # the full cost
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
        stalls = measure_stalls(model, optimizer, Path(tmp), args.repeats, torch_save)
    print(f"{size:.0f} MiB of model + Adam state, one process, best of {args.repeats}")
    print("| how | save (s) | resume (s) | save ratio | resume ratio |")
    print("|---|---|---|---|---|")
    base_save, base_load = rows["torch.save / torch.load(weights_only) + load_state_dict"]
    for how, (save, load) in rows.items():
        ratios = f"{save / base_save:.2f}x | {load / base_load:.2f}x"
        print(f"| {how} | {save:.3f} | {load:.3f} | {ratios} |")
    print()
    print_stalls(stalls, size)


def print_stalls(stalls: dict[str, list[float]], size: float) -> None:
    print(f"Stall per save (the loop waits this long), {size:.0f} MiB, taken alternately")
    print("| how | best (s) | median (s) | vs torch.save | vs memory snapshot |")
    print("|---|---|---|---|---|")
    base, snap = min(stalls["torch.save"]), min(stalls["memory snapshot (clone)"])
    for how, times in stalls.items():
        best = min(times)
        print(f"| {how} | {best:.3f} | {statistics.median(times):.3f} | {best / base:.2f}x | "
              f"{best / snap:.2f}x |")


def every_step(repeats: int, steps: int = 100, width: int = 256) -> None:
    """Milliseconds per training step of a small MLP, saving every step or not (alternately)."""
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    ways = {"no checkpoint": None, 'save() every step, when_busy="skip"': {"when_busy": "skip"},
            "save() every step (waits for the previous write)": {},
            "save(blocking=True) every step": {"blocking": True}}
    times: dict[str, list[float]] = {how: [] for how in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for i, (how, kwargs) in enumerate(ways.items()):
                ckpt = (None if kwargs is None
                        else lockstep.Checkpointer(Path(tmp, f"{repeat}-{i}"), keep=2, **kwargs))
                start = time.perf_counter()
                for step in range(1, steps + 1):
                    optimizer.zero_grad()
                    net(torch.randn(64, width)).pow(2).mean().backward()
                    optimizer.step()
                    if ckpt is not None:
                        ckpt.save(step, model=net, optimizer=optimizer)
                if ckpt is not None:
                    ckpt.wait()
                times[how].append((time.perf_counter() - start) / steps * 1e3)
    base = min(times["no checkpoint"])
    print(f"Saving every step: a {width}-wide MLP, {steps} steps, best of {repeats}")
    print("| how | ms per step | vs no checkpoint |")
    print("|---|---|---|")
    for how, values in times.items():
        print(f"| {how} | {min(values):.2f} | {min(values) / base:.2f}x |")


def measure_stalls(
    model: nn.Module, optimizer: torch.optim.Optimizer, tmp: Path, repeats: int, torch_save
) -> dict[str, list[float]]:
    blocking = lockstep.Checkpointer(tmp / "blocking", keep=1, blocking=True)
    background = lockstep.Checkpointer(tmp / "async", keep=1)  # asynchronous: the default

    def snapshot() -> None:
        {"model": {k: v.clone() for k, v in model.state_dict().items()},
         "optimizer": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                       for k, v in optimizer.state_dict()["state"].items()}}

    waits: list[float] = []

    def save_then_step() -> None:
        background.save(1, model=model, optimizer=optimizer)
        # A pre-hook registered after save()'s runs once the copy is complete: the step's wait.
        copied: list[float] = []
        handle = optimizer.register_step_pre_hook(lambda *_: copied.append(time.perf_counter()))
        start = time.perf_counter()
        optimizer.step()  # waits for the copy of the parameters and optimizer state
        handle.remove()
        waits.append(copied[0] - start)

    ways = {
        "torch.save": torch_save,
        "memory snapshot (clone)": snapshot,
        "Checkpointer.save(blocking=True)": lambda: blocking.save(
            1, model=model, optimizer=optimizer),
        "Checkpointer.save(blocking=False)": lambda: background.save(
            1, model=model, optimizer=optimizer),
        "optimizer.step() alone": optimizer.step,
        "Checkpointer.save(blocking=False), then optimizer.step() at once": save_then_step,
    }
    stalls: dict[str, list[float]] = {how: [] for how in ways}
    for _ in range(repeats):
        for how, fn in ways.items():
            start = time.perf_counter()
            fn()
            stalls[how].append(time.perf_counter() - start)
            background.wait()  # outside the timing: later training steps would overlap it
    stalls["… of which the step waited for the copy"] = waits
    print(f"asynchronous snapshot holds {background.snapshot_bytes / 2**20:.0f} MiB of host memory")
    return stalls


if __name__ == "__main__":
    main()
