"""Exit soak: run finished jobs again and again and count the ones that did not exit 0.

A job whose work is done must never fail at interpreter exit (SIGABRT, "terminate called
without an active exception") nor be restarted. Not part of CI: run it by hand::

    python benchmarks/soak_exit.py --runs 50                       # README-style DDP script
    python benchmarks/soak_exit.py --runs 50 --script resume       # the resume test's script

It prints each run's exit status and, at the end, how many of the runs aborted.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts"


def command(script: str, work: Path) -> list[str]:
    """The `lockstep run` command line for one run of ``script`` in ``work``."""
    launch = [
        sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2",
        "--log-dir", str(work / "logs"),
    ]
    if script == "readme":
        return [*launch, str(SCRIPTS / "readme_ddp.py")]
    return [
        *launch, "--max-restarts", "1", str(SCRIPTS / "resume_train.py"),
        "--ckpt", str(work / "ckpt"), "--out", str(work / "final.pt"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--script", choices=["readme", "resume"], default="readme")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    codes: collections.Counter[int] = collections.Counter()
    restarts = 0
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="lockstep_soak_exit_") as tmp:
            proc = subprocess.run(
                command(args.script, Path(tmp)), cwd=tmp, env=env, check=False, capture_output=True,
                text=True, timeout=args.timeout,
            )
            # One attempt_N folder per start of the workers: a second one is a restart.
            restarted = len(list(Path(tmp, "logs").glob("*/*/attempt_*"))) > 1
        codes[proc.returncode] += 1
        restarts += restarted
        print(f"run {run}: exit {proc.returncode}{' (restarted)' if restarted else ''}", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], flush=True)
    aborted = codes.get(134, 0)
    print(f"{args.script}: {codes[0]} of {args.runs} runs exited 0, {aborted} aborted (134), "
          f"{restarts} restarted; exit statuses {dict(codes)}")


if __name__ == "__main__":
    main()
