"""Goodput under failures: useful steps per second with a SIGKILL of a random rank every N s.

A long scenario, never part of the test suite. For each mode it runs ``goodput_train.py`` for
``--seconds`` without failures, then again killing a random worker every ``--kill-every``
seconds, and compares the steps reached (steps redone after a restore count once)::

    python benchmarks/bench_goodput.py --world 2 --seconds 120 --kill-every 15

Modes: ``torchrun`` (torch's DDP, ``torch.save`` by rank 0, ``torchrun --max-restarts``: the
usual recipe), ``lockstep`` (``lockstep run --max-restarts``, blocking ``Checkpointer``) and
``lockstep-async`` (the same with asynchronous saves, the default), ``lockstep-memory``
(asynchronous, ``Checkpointer(memory=True)``: restores read ``/dev/shm``) and
``lockstep-memory-every-step`` (the same, saving every step), ``lockstep-memory-paced`` (the
same calls, paced to 5% of the time by ``Checkpointer(max_overhead=0.05)``), ``lockstep-survivors``
(``lockstep run --survivors``, ``lockstep.Survivors``, no checkpoint: the survivors go on in a
smaller world, a replacement joins with a peer's state); ``lockstep-async-no-fork`` and
``lockstep-memory-no-fork`` are the two restarting modes with ``lockstep run --no-fork`` (every
worker a new interpreter that imports torch, as before restarted workers were forked from a
server that has it imported). Prints one table row per
mode: steps without and with kills, goodput (their ratio), sample goodput (the same for samples
trained on: in ``lockstep-survivors`` mode a step run by fewer ranks trains on fewer samples;
elsewhere the two are equal), kills, and training time lost per kill, ``(steps without - steps
with) / failure-free steps per second / kills``.

A second table splits the time lost per kill into its parts, measured from the events that
``goodput_train.py`` appends to ``events-rank<r>.jsonl`` (wall-clock ``time.time()``) and the
time and victim of each kill recorded here. For a kill, the processes running at the kill and
their replacements (per rank, the first process created after it) give, each part ending when
the last replacement reaches its event (the mean over kills, in seconds):

- detection+restart: the kill -> the replacement processes exist (``/proc`` start time): the
  agent noticing the death (it polls every 0.1 s), stopping the survivors (SIGTERM, waiting
  for their exit), its own next rendezvous round, and starting the processes; with any
  restart attempts whose processes failed before a step ("failed restarts" counts them, and
  the replacements are then the first processes after the kill that did a step);
- import: -> torch and lockstep imported (the interpreter's start, the launcher's worker
  wrapper, the script's imports, lockstep's parts that it imports on first use);
- rendezvous: -> the process group initialised;
- model: -> the model, its DDP wrapper and the optimizer made;
- restore: -> the checkpoint loaded;
- first step: -> the first step after the restore done (one useful step included);
- redone steps: (the highest step that the killed processes recorded - the restored step) x
  the failure-free step time (from the failure-free run's steps).

Their sum stands next to the first table's "lost per kill", which it should roughly match, and
gives "goodput from the parts", ``1 - kills x sum / --seconds``: what the kills cost, free of the
difference in speed between the failure-free run and the run with kills (on a shared machine two
runs of the same mode differ by up to 10%, as much as seven kills cost). ``--repeats N`` runs N
such pairs per mode, alternately, and the first table gives the median pair and every pair's
goodput.
Not covered: the step in flight at the kill (under one step), steps after the first that run
slower than failure-free ones, and the start-up that "lost per kill" folds into the
failure-free rate (steps / ``--seconds``), which inflates it by ``--seconds / (--seconds -
start-up)``. A kill whose replacements did not finish a step before the next kill or the
deadline is left out of the split ("kills split" counts the rest).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
    "lockstep-memory-paced": ("lockstep-memory", 1),  # with max_overhead (PACED)
    "lockstep-survivors": ("lockstep-survivors", None),
    # The restarting modes with every worker a new interpreter (``lockstep run --no-fork``),
    # as before restarted workers were forked from a server that has torch imported.
    "lockstep-async-no-fork": ("lockstep-async", None),
    "lockstep-memory-no-fork": ("lockstep-memory", None),
}
# Modes whose saves are paced to a share of the time (Checkpointer's max_overhead).
PACED = {"lockstep-memory-paced": 0.05}
# The split's parts: (name, the event that ends it, in the replacement processes).
PARTS = [("detection+restart", "spawn"), ("import", "imported"), ("rendezvous", "initialised"),
         ("model", "built"), ("restore", "restored"), ("first step", "step")]


@dataclass
class Process:
    """One worker process's events from ``events-rank<r>.jsonl``."""

    events: dict[str, float] = field(default_factory=dict)  # event -> its first time
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time, step) per step
    restored: int | None = None  # the restored step


@dataclass
class Run:
    steps: int  # reached at the deadline
    deadline: float
    kills: list[tuple[float, int]]  # (time, victim rank) per kill
    processes: dict[int, list[Process]]  # rank -> its processes, in order of creation
    samples: int  # rank batches trained on: steps x world, fewer where steps ran degraded


def read_events(work: Path, world: int) -> dict[int, list[Process]]:
    processes: dict[int, list[Process]] = {}
    for rank in range(world):
        by_pid: dict[int, Process] = {}
        path = work / f"events-rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by the SIGKILL
            proc = by_pid.setdefault(event["pid"], Process())
            if event["event"] == "step":
                proc.steps.append((event["t"], event["step"]))
                proc.events.setdefault("step", event["t"])
            else:
                proc.events.setdefault(event["event"], event["t"])
                if event["event"] == "restored":
                    proc.restored = event["step"]
        processes[rank] = sorted((p for p in by_pid.values() if "spawn" in p.events),
                                 key=lambda p: p.events["spawn"])
    return processes


def step_time(run: Run) -> float:
    """Seconds per step of a failure-free run, from rank 0's first to last step."""
    steps = run.processes[0][0].steps
    return (steps[-1][0] - steps[0][0]) / (steps[-1][1] - steps[0][1])


def split_kill(run: Run, index: int, per_step: float) -> tuple[list[float], int] | None:
    """Seconds of each part of ``PARTS`` and of the redone steps for kill ``index``, and the
    number of restart attempts that failed before the one that resumed training.

    ``None`` where the replacements did not finish a step before the next kill (or the deadline).
    """
    killed = run.kills[index][0]
    end = run.kills[index + 1][0] if index + 1 < len(run.kills) else run.deadline
    old, new, retries = [], [], 0
    for procs in run.processes.values():
        before = [p for p in procs if p.events["spawn"] < killed]
        after = [p for p in procs if killed < p.events["spawn"] < end]
        stepped = [p for p in after if "step" in p.events]
        if not before or not stepped:
            return None
        old.append(before[-1])
        new.append(stepped[0])
        retries = max(retries, after.index(stepped[0]))
    ends = [killed]
    for _, event in PARTS:
        if any(event not in p.events for p in new):
            return None
        ends.append(max(p.events[event] for p in new))
    if ends[-1] > end:
        return None
    reached = max((step for p in old for _, step in p.steps),
                  default=max(p.restored or 0 for p in old))
    restored = max(p.restored or 0 for p in new)
    parts = [b - a for a, b in itertools.pairwise(ends)]
    return [*parts, max(0, reached - restored) * per_step], retries


def launch(mode: str, world: int, work: Path, deadline: float, every: int,
           spares: int = 1) -> subprocess.Popen:
    if mode == "torchrun":
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        runner = [sys.executable, "-m", "lockstep", "run"]
        if mode == "lockstep-survivors":
            runner += ["--survivors", "--spares", str(spares)]
        if mode.endswith("-no-fork"):
            runner.append("--no-fork")
    command = [*runner, "--max-restarts", "1000", "--nproc-per-node", str(world), str(TRAIN),
               "--mode", MODES[mode][0], "--work", str(work), "--deadline", str(deadline),
               "--every", str(MODES[mode][1] or every)]
    if mode in PACED:
        command += ["--max-overhead", str(PACED[mode])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (work / "log.txt").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_once(mode: str, world: int, seconds: float, kill_every: float | None, every: int,
             rng: random.Random, stuck_after: float = 300.0, spares: int = 1) -> Run:
    """Steps reached in ``seconds`` of training, the kills, and the workers' events."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.time()
        deadline = start + seconds
        proc = launch(mode, world, work, deadline, every, spares)
        kills: list[tuple[float, int]] = []
        next_kill = start + kill_every if kill_every else float("inf")
        while proc.poll() is None:
            now = time.time()
            if now >= next_kill and now < deadline - 1:
                rank = rng.randrange(world)
                try:
                    pid = int((work / f"pid-rank{rank}").read_text())
                    killed = time.time()
                    os.kill(pid, signal.SIGKILL)
                    kills.append((killed, rank))
                except (OSError, ValueError):
                    pass  # that worker is already gone (a restart in progress)
                next_kill += kill_every  # type: ignore[operator]
            if now > deadline + stuck_after:
                proc.kill()
                raise RuntimeError(f"{mode} did not stop {stuck_after:.0f} s after its deadline; "
                                   f"log: {(work / 'log.txt').read_text()[-3000:]}")
            time.sleep(0.05)
        steps_file = work / "steps"
        if proc.returncode != 0 or not steps_file.exists():
            raise RuntimeError(f"{mode} failed ({proc.returncode}):\n"
                               f"{(work / 'log.txt').read_text()[-3000:]}")
        steps = int(steps_file.read_text())
        samples_file = work / "samples"  # written by the survivors mode only
        samples = int(samples_file.read_text()) if samples_file.exists() else steps * world
        run = Run(steps, deadline, kills, read_events(work, world), samples)
    shutil.rmtree(default_memory_root(work / "ckpt"), ignore_errors=True)  # a killed run's copies
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--kill-every", type=float, default=15.0)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stuck-after", type=float, default=300.0,
                        help="give up on a run this many seconds after its deadline")
    parser.add_argument("--spares", type=int, default=1,
                        help="warm spares in the survivors mode (lockstep run --spares)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs of runs per mode (failure-free, then with kills, "
                             "alternately): the row gives the median pair and every pair")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    rng = random.Random(args.seed)
    print(f"world {args.world}, {args.seconds:.0f} s per run, a SIGKILL every "
          f"{args.kill_every:.0f} s, a checkpoint every {args.every} steps")
    print("| mode | steps, no kills | steps, kills | goodput | sample goodput | kills "
          "| lost per kill (s) |")
    print("|---|---|---|---|---|---|---|")
    split_rows: list[str] = []
    survivor_rows: list[str] = []
    try:
        for mode in args.modes:
            try:
                pairs = [run_pair(mode, args, rng) for _ in range(args.repeats)]
            except RuntimeError as err:  # one mode's failure leaves the others' rows
                print(f"| {mode} | failed: {str(err).splitlines()[0]} |||||", flush=True)
                continue
            # The median pair by sample goodput stands for the mode (of an even number, the
            # lower middle one); every pair is listed.
            ranked = sorted(pairs, key=lambda pair: pair[1].samples / pair[0].samples)
            free_run, hit_run = ranked[(len(ranked) - 1) // 2]  # the lower of two middles
            free, hit, kills = free_run.steps, hit_run.steps, len(hit_run.kills)
            sampled = hit_run.samples / free_run.samples
            # Counted in samples: a degraded step (survivors) is not a whole step's training.
            lost = (1 - sampled) * args.seconds / kills if kills else 0.0
            every_pair = (" (pairs: " + ", ".join(f"{h.samples / f.samples:.2f}"
                                                   for f, h in pairs) + ")"
                          if len(pairs) > 1 else "")
            print(f"| {mode} | {free} | {hit} | {hit / free:.2f} | {sampled:.2f}{every_pair} "
                  f"| {kills} | {lost:.2f} |", flush=True)
            per_step = step_time(free_run)
            found = [split for i in range(kills) if (split := split_kill(hit_run, i, per_step))]
            splits = [parts for parts, _ in found]
            means = [sum(column) / len(splits) for column in zip(*splits)] if splits else []
            cells = [f"{m:.2f}" for m in [*means, sum(means)]] if splits else ["-"] * (len(PARTS) + 2)
            # What the parts alone would leave: free of the two runs' difference in speed.
            cells.append(f"{1 - kills * sum(means) / args.seconds:.2f}" if splits else "-")
            split_rows.append(f"| {mode} | {len(splits)} of {kills} | {sum(r for _, r in found)} | "
                              f"{per_step * 1e3:.1f} | {' | '.join(cells)} | {lost:.2f} |")
            if MODES[mode][0] == "lockstep-survivors":
                survivor_rows.append(survivors_row(mode, hit_run, per_step, lost))
    finally:  # the split of the modes done, even when a later one fails
        print_split(split_rows)
        if survivor_rows:
            print("\nSurvivors: per kill (mean seconds): the survivors' pause (the kill -> their "
                  "next step, less one step), the time degraded (the kill -> the replacement's "
                  "first step) and the replacement's start (its spawn -> torch and lockstep "
                  "imported; a warm spare did that before the kill)")
            print("| mode | kills | step (ms) | pause | degraded | replacement import "
                  "| lost per kill |")
            print("|---|---|---|---|---|---|---|")
            for row in survivor_rows:
                print(row, flush=True)


def run_pair(mode: str, args: argparse.Namespace, rng: random.Random) -> tuple[Run, Run]:
    """A failure-free run of ``mode``, then one with a kill every ``--kill-every`` seconds."""
    free_run = run_once(mode, args.world, args.seconds, None, args.every, rng,
                        spares=args.spares)
    if free_run.samples == 0:
        raise RuntimeError(f"no step in {args.seconds:.0f} s without failures: give more "
                           "--seconds")
    hit_run = run_once(mode, args.world, args.seconds, args.kill_every, args.every, rng,
                       args.stuck_after, args.spares)
    return free_run, hit_run


def survivors_row(mode: str, run: Run, per_step: float, lost: float) -> str:
    """One row of the survivors' table: the means over the kills whose parts all happened."""
    pauses, degraded, imports = [], [], []
    for index, (killed, victim) in enumerate(run.kills):
        end = run.kills[index + 1][0] if index + 1 < len(run.kills) else run.deadline
        after = [t for rank, procs in run.processes.items() if rank != victim for p in procs
                 if p.events["spawn"] < killed for t, _ in p.steps if t > killed]
        if after:
            pauses.append(max(0.0, min(after) - killed - per_step))
        # The replacement: a new process, or a warm spare given the rank (its "initialised").
        fresh = [p for p in run.processes.get(victim, [])
                 if killed < p.events.get("initialised", p.events["spawn"]) < end]
        if fresh and fresh[0].steps:
            degraded.append(fresh[0].steps[0][0] - killed)
            if "imported" in fresh[0].events:
                imports.append(fresh[0].events["imported"] - fresh[0].events["spawn"])

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.2f}" if values else "-"

    return (f"| {mode} | {len(run.kills)} | {per_step * 1e3:.1f} | {mean(pauses)} | "
            f"{mean(degraded)} | {mean(imports)} | {lost:.2f} |")


def print_split(split_rows: list[str]) -> None:
    print("\nTime lost per kill, by part (mean seconds per kill; see the docstring):")
    names = [name for name, _ in PARTS] + ["redone steps"]
    print(f"| mode | kills split | failed restarts | step (ms) | {' | '.join(names)} | sum "
          "| goodput from the parts | lost per kill |")
    print("|---" * (len(names) + 7) + "|")
    for row in split_rows:
        print(row, flush=True)


if __name__ == "__main__":
    main()
