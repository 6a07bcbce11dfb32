"""Goodput under failures: useful steps per second with a SIGKILL of a random rank every N s.

A long scenario, never part of the test suite. For each mode it runs ``goodput_train.py`` for
``--seconds`` without failures, then again killing a random worker every ``--kill-every``
seconds, and compares the steps reached (steps redone after a restore count once)::

    python benchmarks/bench_goodput.py --world 2 --seconds 120 --kill-every 15

Modes: ``torchrun`` (torch's DDP, ``torch.save`` by rank 0, ``torchrun --max-restarts``: the
usual recipe), ``lockstep`` (``lockstep run --max-restarts``, blocking ``Checkpointer``) and
``lockstep-async`` (the same with asynchronous saves, the default), ``lockstep-memory``
(asynchronous, ``Checkpointer(memory=True)``: restores read ``/dev/shm``) and
``lockstep-memory-every-step`` (the same, saving every step). Prints one table row per
mode: steps without and with kills, goodput (their ratio), kills, and training time lost per
kill, ``(steps without - steps with) / failure-free steps per second / kills``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep.checkpoint.replicas import default_memory_root

TRAIN = Path(__file__).with_name("goodput_train.py")
# mode -> (goodput_train.py --mode, checkpoint every N steps: None = --every)
MODES: dict[str, tuple[str, int | None]] = {
    "torchrun": ("torch", None),
    "lockstep": ("lockstep", None),
    "lockstep-async": ("lockstep-async", None),
    "lockstep-memory": ("lockstep-memory", None),
    "lockstep-memory-every-step": ("lockstep-memory", 1),
}


def launch(mode: str, world: int, work: Path, deadline: float, every: int) -> subprocess.Popen:
    if mode == "torchrun":
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        runner = [sys.executable, "-m", "lockstep", "run"]
    command = [*runner, "--max-restarts", "1000", "--nproc-per-node", str(world), str(TRAIN),
               "--mode", MODES[mode][0], "--work", str(work), "--deadline", str(deadline),
               "--every", str(MODES[mode][1] or every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (work / "log.txt").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_once(mode: str, world: int, seconds: float, kill_every: float | None, every: int,
             rng: random.Random) -> tuple[int, int]:
    """Steps reached in ``seconds`` of training, and the number of kills."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.time()
        deadline = start + seconds
        proc = launch(mode, world, work, deadline, every)
        kills = 0
        next_kill = start + kill_every if kill_every else float("inf")
        while proc.poll() is None:
            now = time.time()
            if now >= next_kill and now < deadline - 1:
                rank = rng.randrange(world)
                try:
                    os.kill(int((work / f"pid-rank{rank}").read_text()), signal.SIGKILL)
                    kills += 1
                except (OSError, ValueError):
                    pass  # that worker is already gone (a restart in progress)
                next_kill += kill_every  # type: ignore[operator]
            if now > deadline + 300:
                proc.kill()
                raise RuntimeError(f"{mode} did not stop; log: {(work / 'log.txt').read_text()}")
            time.sleep(0.05)
        steps_file = work / "steps"
        if proc.returncode != 0 or not steps_file.exists():
            raise RuntimeError(f"{mode} failed ({proc.returncode}):\n"
                               f"{(work / 'log.txt').read_text()[-3000:]}")
        steps = int(steps_file.read_text())
    shutil.rmtree(default_memory_root(work / "ckpt"), ignore_errors=True)  # a killed run's copies
    return steps, kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--kill-every", type=float, default=15.0)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"world {args.world}, {args.seconds:.0f} s per run, a SIGKILL every "
          f"{args.kill_every:.0f} s, a checkpoint every {args.every} steps")
    print("| mode | steps, no kills | steps, kills | goodput | kills | lost per kill (s) |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        free, _ = run_once(mode, args.world, args.seconds, None, args.every, rng)
        hit, kills = run_once(mode, args.world, args.seconds, args.kill_every, args.every, rng)
        rate = free / args.seconds
        lost = (free - hit) / rate / kills if kills else 0.0
        print(f"| {mode} | {free} | {hit} | {hit / free:.2f} | {kills} | {lost:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
