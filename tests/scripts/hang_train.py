"""A job in which rank 1 never reaches an all-reduce: the others must fail, naming it.

Run as ``lockstep run --nproc-per-node 2 tests/scripts/hang_train.py --timeout 3``: rank 0 raises
``CollectiveTimeoutError`` after the timeout, and the launcher stops rank 1 (which would sleep
for an hour) and reports rank 0's error as the root cause.
"""

from __future__ import annotations

import argparse
import time

import torch

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    info = lockstep.init_distributed()
    watchdog = lockstep.CollectiveWatchdog(timeout=args.timeout)
    loss = torch.ones(1)
    watchdog.all_reduce(loss)  # every rank takes part once
    if info.rank == 1:
        time.sleep(3600)  # stuck: a deadlock, a dead data loader, a debugger left attached
    watchdog.all_reduce(loss)
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
