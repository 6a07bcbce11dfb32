"""A paced DDP training run for tests/test_multimachine.py, one launcher per "machine".

Usage: machines.py OUTDIR STEPS [--delay S] [--ckpt DIR --every N] [--mark STEP]
       [--kill-rank R --kill-at STEP]

Every rank trains a tiny model with lockstep's DDP and DistributedSampler on a fixed dataset,
sleeping ``--delay`` seconds per step (so a test can kill a machine mid-run). Each attempt's
rank 0 writes OUTDIR/final_<restart>.pt (the weights) and OUTDIR/world_<restart>.json (the
world size and the samples every rank saw, in order). With ``--ckpt``, it saves a checkpoint
every ``--every`` steps and resumes from the newest on a restart, at whatever world size.
With ``--kill-rank``, that rank SIGKILLs itself after step ``--kill-at``, the first time only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--mark", type=int, default=-1, help="at this step rank 0 writes OUTDIR/reached")
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself once")
    parser.add_argument("--kill-at", type=int, default=-1, help="... after this step")
    args = parser.parse_args()
    info = lockstep.init_distributed()
    generator = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.arange(48.0), torch.randn(48, 4, generator=generator),
                            torch.randn(48, 1, generator=generator))
    sampler = lockstep.DistributedSampler(dataset, shuffle=True, seed=5)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = {"model": model, "optimizer": optimizer, "sampler": sampler}
    ckpt = lockstep.Checkpointer(args.ckpt, keep=2, blocking=True) if args.ckpt else None
    resumed = ckpt.restore(**objects) if ckpt else None
    step, epoch = (resumed.step, resumed.epoch) if resumed else (0, 0)
    seen: list[int] = []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for index, x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            seen += [int(i) for i in index]
            if ckpt and step % args.every == 0:
                ckpt.save(step, epoch=epoch, **objects)
            killed = Path(args.outdir) / "killed"
            if step == args.kill_at and info.rank == args.kill_rank and not killed.exists():
                killed.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.mark and info.rank == 0:
                (Path(args.outdir) / "reached").write_text(str(step))
            time.sleep(args.delay)
            if step >= args.steps:
                break
        else:
            epoch += 1
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, seen)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if info.rank == 0:
        out = Path(args.outdir)
        torch.save(model.module.state_dict(), out / f"final_{restart}.pt")
        (out / f"world_{restart}.json").write_text(
            json.dumps({"world": info.world_size, "seen": everyone, "start": resumed.step
                        if resumed else 0}))
    print(f"finished at world {info.world_size}", flush=True)
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
