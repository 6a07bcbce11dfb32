"""A job for tests/test_survivors.py: trains under ``lockstep.Survivors`` on a DataLoader over a
``lockstep.DistributedSampler`` (through ``team.batches``), optionally killing one slot's first
process at a step, and records what the test compares:

- ``--out``: rank 0's final parameters and the world's history (first step, slots) per world;
- ``--ckpt``: a ``Checkpointer`` saving inside the step every ``--save-every`` steps
  (asynchronous unless ``--blocking``); at the end the newest checkpoint is restored into a new
  model, and ``--out`` holds its step and parameters too;
- ``--log-dir``: one line per completed step and process, ``step epoch slot index...`` (the
  samples it trained on), so the test can replay the same steps and check the sample stream;
- ``--lose-machine NODE:STEP``: at that step the first worker of machine NODE (its first
  launcher's) takes its whole machine down: SIGKILL to its process group (the test starts each
  machine's launcher in a session of its own), or SIGSTOP with ``--silent`` (a machine that
  vanishes without closing its connections).

    lockstep run --survivors --max-restarts 1 --nproc-per-node 3 survivors_train.py \
        --steps 24 --kill 1:6 --out out.pt --log-dir logs

``build``, ``dataset`` and ``train_on`` are shared with the test's replay.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lockstep

BATCH = 8
SAMPLES = 240


class Indexed(Dataset):
    """``SAMPLES`` fixed inputs; an item is ``(index, input)``."""

    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.data[index]


def dataset() -> torch.Tensor:
    return torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(1))


def build(process_group=None) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    model = lockstep.DistributedDataParallel(net, process_group=process_group)
    return net, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_on(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill", action="append", default=[], metavar="SLOT:STEP",
                        help="SIGKILL the slot's first process at that step (repeatable)")
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--ckpt", help="a Checkpointer's directory: save inside the step")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--blocking", action="store_true", help="blocking saves")
    parser.add_argument("--max-overhead", type=float, default=None,
                        help="Checkpointer(max_overhead=...): saves paced (the last one blocking)")
    parser.add_argument("--lose-machine", metavar="NODE:STEP", help="take a machine down")
    parser.add_argument("--silent", action="store_true", help="SIGSTOP the machine, not SIGKILL")
    parser.add_argument("--admit-every", type=int, default=2, help="Survivors(admit_every=...)")
    parser.add_argument("--no-finish", action="store_true", help="end without team.finish()")
    args = parser.parse_args()
    kills = {tuple(int(v) for v in pair.split(":")) for pair in args.kill}
    if args.lose_machine:
        node, step = (int(v) for v in args.lose_machine.split(":"))
        if int(os.environ.get("GROUP_RANK", "0")) == node and os.environ.get("LOCAL_RANK") == "0":
            kills.add(("machine", step))
    team = lockstep.Survivors(admit_every=args.admit_every)
    net, model, optimizer = build()
    team.track(model, optimizer)
    slot = int(os.environ.get("RANK", "0"))
    replacement = os.environ.get("LOCKSTEP_SURVIVOR_JOIN") == "1"
    sampler = lockstep.DistributedSampler(Indexed(), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    ckpt = (lockstep.Checkpointer(args.ckpt, blocking=args.blocking, max_overhead=args.max_overhead)
            if args.ckpt else None)
    log = (Path(args.log_dir) / f"slot{slot}-{os.getpid()}.txt").open("w", buffering=1)
    for indices, x in team.batches(loader, epochs=1000):
        if team.completed >= args.steps:
            break
        with team.step():
            if (slot, team.completed) in kills and not replacement:
                os.kill(os.getpid(), 9)
            if ("machine", team.completed) in kills and not replacement:
                os.killpg(os.getpgid(0), signal.SIGSTOP if args.silent else signal.SIGKILL)
            train_on(model, optimizer, x)
            if ckpt is not None and (team.completed + 1) % args.save_every == 0:
                last = args.max_overhead is not None and team.completed + 1 == args.steps
                ckpt.save(team.completed + 1, model=model, optimizer=optimizer,
                          blocking=True if last else None)
            print(team.completed, sampler.epoch, slot, *indices.tolist(), file=log)
            # Slow while the world is short: room for the replacement to start before the end.
            time.sleep(args.sleep if team.world_size == team.slots else 0.5)
    restored = None
    if ckpt is not None:  # the newest checkpoint, read back by the world as it is now
        fresh_net, fresh_model, fresh_optimizer = build()
        found = ckpt.restore(model=fresh_model, optimizer=fresh_optimizer)
        restored = (found.step if found else None,
                    [p.detach().clone() for p in fresh_net.parameters()])
    if team.rank == 0:
        torch.save({"params": [p.detach().clone() for p in net.parameters()],
                    "history": team.history, "restored": restored,
                    "env": {k: os.environ.get(k) for k in ("TORCHELASTIC_MAX_RESTARTS",
                                                           "TORCHELASTIC_RESTART_COUNT")}},
                   args.out)
    if not args.no_finish:
        team.finish()


if __name__ == "__main__":
    main()
