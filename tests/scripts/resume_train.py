"""A small training run that survives a killed worker: resuming is the one ``restore`` call.

Run under a launcher that restarts failed workers, e.g.::

    lockstep run --max-restarts 1 --nproc-per-node 2 tests/scripts/resume_train.py \
        --ckpt /tmp/ck --out /tmp/final.pt --kill-rank 1 --kill-at-step 7 --marker /tmp/killed

With ``--kill-rank``, that rank SIGKILLs itself after optimizer step ``--kill-at-step`` the first
time only (``--marker`` remembers it), after the newest checkpoint and before the next one, so
the work in between is lost and redone. Rank 0 writes the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="where rank 0 writes the final weights")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--marker", default="", help="file that says the kill already happened")
    parser.add_argument("--async-save", action="store_true", help="Checkpointer(blocking=False)")
    parser.add_argument("--model", choices=["small", "blocks"], default="small",
                        help="blocks: residual blocks in several small buckets (layout matters)")
    return parser.parse_args()


class Block(nn.Module):
    """A residual MLP block with LayerNorm: parameters of several sizes, arrival order mixed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 3 * width), \
            nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build_model(kind: str = "small") -> nn.Module:
    torch.manual_seed(0)
    if kind == "blocks":
        return nn.Sequential(nn.Linear(6, 24), Block(24), nn.Dropout(0.2), Block(24), Block(24),
                             nn.Linear(24, 2))
    # Dropout draws from each rank's RNG: an exact resume must restore those states too.
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def main() -> None:
    args = parse_args()
    info = lockstep.init_distributed()
    generator = torch.Generator().manual_seed(1234)
    inputs, targets = torch.randn(40, 6, generator=generator), torch.randn(40, 2, generator=generator)
    dataset = TensorDataset(inputs, targets)
    sampler = lockstep.DistributedSampler(dataset, shuffle=True, seed=3)
    # A DataLoader draws a seed from the global RNG each time iteration starts; its own
    # generator keeps a mid-epoch resume from shifting the global (dropout) stream.
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, generator=torch.Generator())
    # Small buckets for "blocks": several parameters share each one, so a bucket layout that
    # differed between the first and the resumed run would round the sums differently.
    cap = 0.004 if args.model == "blocks" else 25
    model = lockstep.DistributedDataParallel(build_model(args.model), bucket_cap_mb=cap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    torch.manual_seed(100 + info.rank)

    ckpt = lockstep.Checkpointer(args.ckpt, keep=2, blocking=not args.async_save)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    resumed = ckpt.restore(**objects)  # the whole of the resume logic
    step, start_epoch = (resumed.step, resumed.epoch) if resumed else (0, 0)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # keeps a resumed sampler's place in its epoch
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            marker = Path(args.marker) if args.marker else None
            if step == args.kill_at_step and info.rank == args.kill_rank and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.every == 0:
                ckpt.save(step, epoch=epoch, **objects)
        scheduler.step()

    if info.rank == 0:
        torch.save(model.state_dict(), args.out)
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
