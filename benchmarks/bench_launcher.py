"""Benchmark `lockstep run` against torchrun: time to run a 2-worker job, and to stop a failed one.

Both launchers start the same tiny script (join the world, one all-reduce, exit), in rounds
that alternate the launchers so that load from other processes hits them alike. Reported:
best and median wall time of a successful job, and of a job whose rank 1 raises while rank 0
waits in a barrier (the time until the launcher has stopped everything and exited). torchrun
is run with --standalone, the flag lockstep's single-machine default corresponds to.

    python benchmarks/bench_launcher.py              # 3 rounds
    python benchmarks/bench_launcher.py --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = """
import sys, torch, torch.distributed as dist, lockstep
info = lockstep.init_distributed()
t = torch.ones(1); dist.all_reduce(t)
if sys.argv[1] == "fail" and info.rank == 1:
    raise ValueError("rank 1 fails")
dist.barrier()
lockstep.shutdown_distributed()
"""

LAUNCHERS = {
    "lockstep run": [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2"],
    "torchrun --standalone": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ],
}


def _time_job(cmd: list[str], script: str, mode: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([*cmd, script, mode], capture_output=True, text=True, timeout=300,
                          check=False)
    elapsed = time.perf_counter() - start
    if (done.returncode == 0) != (mode == "ok"):
        raise RuntimeError(f"{cmd[2:4]} {mode}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "tiny.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for _ in range(args.rounds):
            for mode in ("ok", "fail"):
                for name, cmd in LAUNCHERS.items():
                    times.setdefault((name, mode), []).append(_time_job(cmd, script, mode))
    print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| job | launcher | best s | median s | best vs torchrun |")
    print("|---|---|---|---|---|")
    for mode, label in (
        ("ok", "2 workers, one all-reduce"),
        ("fail", "rank 1 raises, rank 0 waits"),
    ):
        base = min(times[("torchrun --standalone", mode)])
        for name in LAUNCHERS:
            t = times[(name, mode)]
            print(
                f"| {label} | {name} | {min(t):.2f} | {statistics.median(t):.2f} "
                f"| {min(t) / base:.2f}x |"
            )


if __name__ == "__main__":
    main()
