"""A job for tests/test_survivors.py: trains under ``lockstep.Survivors``, optionally killing
one slot's first process at a step, and saves the final parameters and the world's history.

    lockstep run --survivors --max-restarts 1 --nproc-per-node 3 survivors_train.py \
        --steps 24 --kill-slot 1 --kill-at 6 --out out.pt

``build`` and ``train_step`` are shared with the test's replay, which runs the same steps on
the recorded schedule of worlds without killing anything.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import lockstep


def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    model = lockstep.DistributedDataParallel(net)
    return net, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, slot: int) -> None:
    """One step; the data depends on the step and the slot (the rank as launched) only."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 1000 + slot))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-slot", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    team = lockstep.Survivors(admit_every=2)
    net, model, optimizer = build()
    team.track(model, optimizer)
    slot = int(os.environ.get("RANK", "0"))
    replacement = os.environ.get("LOCKSTEP_SURVIVOR_JOIN") == "1"
    while team.completed < args.steps:
        with team.step():
            if slot == args.kill_slot and team.completed == args.kill_at and not replacement:
                os.kill(os.getpid(), 9)
            train_step(model, optimizer, team.completed, slot)
            # Slow while the world is short: room for the replacement to start before the end.
            time.sleep(args.sleep if team.world_size == team.slots else 0.5)
    if team.rank == 0:
        torch.save({"params": [p.detach().clone() for p in net.parameters()],
                    "history": team.history}, args.out)
    team.finish()


if __name__ == "__main__":
    main()
