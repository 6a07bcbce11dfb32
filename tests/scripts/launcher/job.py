"""A worker script for tests/test_launcher.py, run under `lockstep run` (or plain python).

Usage: job.py MODE OUTDIR [MARKER]

Every rank joins the world, all-reduces its rank + 1, and writes OUTDIR/rank<R>_attempt<A>.json
with what it saw (environment, the sum, the addresses its own and its launcher's sockets listen
on). Then, by MODE:
  ok         finish.
  fail       rank 1 raises ValueError while the others wait in a barrier.
  kill-once  rank 1 kills itself with SIGKILL on the first attempt; the restart finishes.
  hang       every rank sleeps (for the launcher to be killed).
MARKER is ignored: it only tags the command line so the test can look for leftover processes.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import lockstep

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listening_addresses(pids: list[int]) -> list[str]:
    """Hex local addresses ('0100007F:1F90') that these processes listen on."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    found.append(fields[1])
    return found


def main() -> None:
    mode, outdir = sys.argv[1], sys.argv[2]
    info = lockstep.init_distributed()
    total = torch.tensor([float(info.rank + 1)], device=info.device)
    dist.all_reduce(total)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "OMP_NUM_THREADS",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "ROLE_NAME",
    )
    report = {
        "env": {k: os.environ.get(k) for k in keys},
        "sum": total.item(),
        "listening": listening_addresses([os.getpid(), os.getppid()]),
        "pid": os.getpid(),
        "file": __file__,
    }
    with open(os.path.join(outdir, f"rank{info.rank}_attempt{attempt}.json"), "w") as fh:
        json.dump(report, fh)
    print(f"hello from rank {info.rank} of {info.world_size}", flush=True)
    dist.barrier()
    if mode == "fail" and info.rank == 1:
        with open(os.path.join(outdir, "failing_at"), "w") as fh:
            fh.write(repr(time.time()))
        raise ValueError("rank 1 fails on purpose")
    if mode == "kill-once" and info.rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(600)
    if mode == "fail" and info.rank != 1:
        dist.barrier()  # never completes: rank 1 is gone; the launcher must stop us
        time.sleep(600)
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
