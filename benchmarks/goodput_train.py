"""The training job that ``bench_goodput.py`` launches and kills (one process per rank).

Trains a small MLP until the wall-clock ``--deadline`` (rank 0 decides, all ranks stop at the
same step), saving every ``--every`` steps and resuming from the newest checkpoint at start:

- ``--mode torch``: torch's DDP, ``torch.save``/``torch.load`` by rank 0 (run under torchrun);
- ``--mode lockstep``: lockstep's DDP and ``Checkpointer`` (blocking saves);
- ``--mode lockstep-async``: the same with asynchronous saves (the default);
- ``--mode lockstep-memory``: asynchronous saves, ``Checkpointer(memory=True)``: restores read
  the copies in shared memory (``/dev/shm``).
- ``--mode lockstep-survivors``: ``lockstep.Survivors`` under ``lockstep run --survivors``: no
  checkpoint; the survivors keep training in a smaller world, a replacement joins and receives
  the state from a peer. Rank 0 also writes the samples trained on (``samples``: the sum over
  steps of the world size, in units of one rank's batch), since degraded steps train on fewer.

With ``--every 1`` the lockstep modes pass ``when_busy="skip"``: a save that finds the previous
one still being written is skipped, so the loop saves as often as the disk allows; with
``--max-overhead S`` too, saves are paced to that share of the time (``Checkpointer``'s
``max_overhead``).

Each rank writes its pid to ``pid-rank<r>`` so the benchmark can kill it; rank 0 writes the
step reached to ``steps`` at the deadline.

Each process also appends timestamped events (``time.time()``, comparable across processes) to
``events-rank<r>.jsonl`` in ``--work``, one JSON object a line with ``t``, ``pid``, ``event``
and for some a ``step``, for ``bench_goodput.py`` to split the time lost per kill:

- ``spawn``: when the kernel created the process (``/proc/self/stat``, 10 ms resolution):
  under ``lockstep run`` the script runs inside a wrapper that imports torch first, so the
  script's first line comes after most of the import time;
- ``start``: the script's first line, before importing torch;
- ``imported``: torch and lockstep imported, with the DDP wrapper and checkpointer classes
  that lockstep imports on first use;
- ``initialised``: the process group is up (rendezvous done);
- ``built``: the model, its DDP wrapper and the optimizer are made;
- ``restored``: the checkpoint is loaded (``step``: the restored step, 0 without one);
- ``step``: the end of every step (``step``: the step counter), one unbuffered ``os.write``
  per step, so a SIGKILLed process has recorded every step it completed (the write costs
  a few microseconds, well under 1% of a step).
"""

from __future__ import annotations

import os
import time

_START = time.time()  # the script's first line: before importing torch

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lockstep


def _spawn_time() -> float:
    """When the kernel created this process, in ``time.time()`` terms (10 ms resolution)."""
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - (uptime - started)


class Events:
    """Appends one JSON line per event to ``events-rank<r>.jsonl``, unbuffered (survives SIGKILL)."""

    def __init__(self, work: Path) -> None:
        path = work / f"events-rank{os.environ.get('RANK', '0')}.jsonl"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()

    def __call__(self, event: str, t: float | None = None, step: int | None = None) -> None:
        t = time.time() if t is None else t
        extra = "" if step is None else f', "step": {step}'
        line = f'{{"t": {t:.6f}, "pid": {self.pid}, "event": "{event}"{extra}}}\n'
        os.write(self.fd, line.encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=[
        "torch", "lockstep", "lockstep-async", "lockstep-memory", "lockstep-survivors"])
    parser.add_argument("--work", required=True)
    parser.add_argument("--deadline", type=float, required=True, help="time.time() to stop at")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--max-overhead", type=float, default=None,
                        help="Checkpointer(max_overhead=...) (asynchronous lockstep modes)")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    work = Path(args.work)
    spawned = _spawn_time()
    if args.mode == "lockstep-survivors":  # a warm spare learns its rank in Survivors()
        early: list[tuple[str, float]] = [("spawn", spawned), ("start", _START)]
        events: Events | Callable[..., None] = lambda event, t=None, step=None: early.append(
            (event, time.time() if t is None else t))
    else:
        events = Events(work)
        events("spawn", spawned)
        events("start", _START)
    # lockstep imports its parts on first use (DistributedDataParallel brings torch._dynamo,
    # seconds on a busy machine): import them here so that "imported" covers every import.
    if args.mode == "torch":
        ddp_class = nn.parallel.DistributedDataParallel
    else:
        ddp_class = lockstep.DistributedDataParallel
        lockstep.Checkpointer  # noqa: B018
    events("imported")
    team = None
    if args.mode == "torch":
        dist.init_process_group("gloo")
    elif args.mode == "lockstep-survivors":
        team = lockstep.Survivors()
        events = Events(work)  # RANK is known now
        for event, t in early:
            events(event, t)
    else:
        lockstep.init_distributed()
    events("initialised")
    if team is not None:
        survive(args, team, work, events)
        return
    rank = dist.get_rank()
    (work / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    model: nn.Module = ddp_class(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    events("built")
    step = 0
    ckpt = None
    if args.mode == "torch":
        path = work / "torch-ckpt.pt"
        if path.exists():
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
    else:
        ckpt = lockstep.Checkpointer(work / "ckpt", keep=2, blocking=args.mode == "lockstep",
                                     memory=args.mode == "lockstep-memory",
                                     when_busy="skip" if args.every == 1 else "wait",
                                     max_overhead=args.max_overhead)
        resumed = ckpt.restore(model=model, optimizer=optimizer)
        step = resumed.step if resumed else 0
    events("restored", step=step)
    stop = torch.zeros(1)
    while True:
        stop.fill_(float(rank == 0 and time.time() > args.deadline))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, args.width, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        step += 1
        events("step", step=step)
        if step % args.every == 0:
            if ckpt is not None:
                ckpt.save(step, model=model, optimizer=optimizer)
            elif rank == 0:
                tmp = work / "torch-ckpt.pt.tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, work / "torch-ckpt.pt")
    if ckpt is not None:
        ckpt.close()  # waits for the last save; removes the shared-memory copies
    if rank == 0:
        Path(work / "steps").write_text(str(step))
    dist.destroy_process_group()


class Samples:
    """Rank batches trained on (a step at world size W counts W): travels to a replacement."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def survive(args: argparse.Namespace, team: lockstep.Survivors, work: Path,
            events: Events | Callable[..., None]) -> None:
    """The loop of ``--mode lockstep-survivors``: every step inside ``team.step()``."""
    slot = int(os.environ.get("RANK", "0"))
    (work / f"pid-rank{slot}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    model = lockstep.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    samples = Samples()
    team.track(model, optimizer, samples=samples)
    events("built")
    events("restored", step=team.completed)
    stop = torch.zeros(1)
    finished = False
    while not finished:
        with team.step():
            stop.fill_(float(team.rank == 0 and time.time() > args.deadline))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                finished = True
            else:
                generator = torch.Generator().manual_seed(team.completed * 1000 + slot)
                x = torch.randn(64, args.width, generator=generator)
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
                samples.count += team.world_size
                events("step", step=team.completed + 1)
    if team.rank == 0:
        (work / "samples").write_text(str(samples.count))
        (work / "steps").write_text(str(team.completed - 1))  # the last step only stopped
    team.finish()


if __name__ == "__main__":
    main()
