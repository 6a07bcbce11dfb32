"""A DDP job in which one rank stops: run by tests/test_hangs.py under `lockstep run`.

Usage: hang_ddp.py MODE CULPRIT TIMEOUT_S

  sleep   rank CULPRIT sleeps (an hour) between forward and backward of step 3;
  leave   rank CULPRIT leaves the training loop after step 2 and exits with 0;
  shapes  (run with LOCKSTEP_DEBUG_COLLECTIVES=1) rank CULPRIT all-reduces a tensor of
          another shape, checked first by lockstep.check_collective.
  skip    at step 3 rank CULPRIT skips a DDP backward (and so its gradient all-reduce) while
          its peers run it: its next all-reduce, a larger one, meets theirs (no debug mode), and
          gloo aborts a peer.

The others wait in a collective; it must fail within TIMEOUT_S plus a few seconds naming
CULPRIT, and the launcher must report CULPRIT as the root cause.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import lockstep


def main() -> None:
    mode, culprit, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    info = lockstep.init_distributed(timeout=timedelta(seconds=timeout))
    # Start together: on a loaded machine, start-up alone can outlast the short timeout.
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    if mode == "shapes":
        t = torch.zeros(5 if info.rank == culprit else 4)
        lockstep.check_collective("all_reduce", [t])
        dist.all_reduce(t)
        return
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "skip":
        # A batch skipped on one rank: its gradient all-reduce (2 floats) is missing there, and
        # its logging all-reduce (16 floats) meets its peers' gradient all-reduce instead.
        small = lockstep.DistributedDataParallel(nn.Linear(1, 1))
        for step in range(1, 6):
            loss = small(torch.ones(2, 1)).sum()
            if not (info.rank == culprit and step == 3):
                loss.backward()
            dist.all_reduce(torch.full((16,), loss.item()))
        lockstep.shutdown_distributed()
        return
    for step in range(1, 6):
        if mode == "leave" and info.rank == culprit and step == 3:
            return  # uneven data: this rank's loader ran out
        loss = model(torch.ones(2, 4)).sum()
        if mode == "sleep" and info.rank == culprit and step == 3:
            time.sleep(3600)  # a dead data loader, a deadlock, a debugger left attached
        loss.backward()
        opt.step()
        opt.zero_grad()
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
