"""The training job that ``bench_goodput.py`` launches and kills (one process per rank).

Trains a small MLP until the wall-clock ``--deadline`` (rank 0 decides, all ranks stop at the
same step), saving every ``--every`` steps and resuming from the newest checkpoint at start:

- ``--mode torch``: torch's DDP, ``torch.save``/``torch.load`` by rank 0 (run under torchrun);
- ``--mode lockstep``: lockstep's DDP and ``Checkpointer`` (blocking saves);
- ``--mode lockstep-async``: the same with asynchronous saves (the default);
- ``--mode lockstep-memory``: asynchronous saves, ``Checkpointer(memory=True)``: restores read
  the copies in shared memory (``/dev/shm``).

With ``--every 1`` the lockstep modes pass ``when_busy="skip"``: a save that finds the previous
one still being written is skipped, so the loop saves as often as the disk allows.

Each rank writes its pid to ``pid-rank<r>`` so the benchmark can kill it; rank 0 writes the
step reached to ``--out`` at the deadline.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["torch", "lockstep", "lockstep-async", "lockstep-memory"], required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--deadline", type=float, required=True, help="time.time() to stop at")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    work = Path(args.work)
    if args.mode == "torch":
        dist.init_process_group("gloo")
    else:
        lockstep.init_distributed()
    rank = dist.get_rank()
    (work / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    if args.mode == "torch":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    else:
        model = lockstep.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
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
                                     when_busy="skip" if args.every == 1 else "wait")
        resumed = ckpt.restore(model=model, optimizer=optimizer)
        step = resumed.step if resumed else 0
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


if __name__ == "__main__":
    main()
