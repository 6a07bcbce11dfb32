"""Rank 0 stops waiting for a dead rank's part of an asynchronous save at once (issue #24).

Before the liveness locks, rank 0's writing thread waited out its whole bound (the
Checkpointer's timeout; 10 s after a SIGTERM) for files a SIGKILLed rank never writes, which
stalled every restart of a job that saves each step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import liveness
from lockstep.checkpoint.background import BackgroundSave, _in_turn
from lockstep.checkpoint.liveness import ALIVE_DIR, LivenessLocks, is_gone

# A process that holds its lock in the directory given, forks a child that outlives it (as a
# DataLoader worker would; the child takes a lock of its own, named in ``child``), prints its
# file's name, and sleeps. liveness.py imports nothing of lockstep: loaded alone, without torch,
# the holder starts fast.
_HOLDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("liveness", sys.argv[2])
    liveness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(liveness)
    locks = liveness.LivenessLocks()
    directory = Path(sys.argv[1])
    name = locks.hold(directory)
    if os.fork() == 0:
        Path(directory, "child.tmp").write_text(locks.hold(directory) or "")
        os.replace(Path(directory, "child.tmp"), Path(directory, "child"))
        time.sleep(60)
        os._exit(0)
    while not Path(directory, "child").exists():
        time.sleep(0.01)
    print(name, flush=True)
    time.sleep(60)
""")


def _start_holder(directory: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), liveness.__file__],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name == f"{socket.gethostname()}-{proc.pid}", name
    return proc, name


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the holder alone: its forked child lives on until the test ends."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def start_holder():
    """``_start_holder``, with every process it started (and their children) killed after."""
    started: list[subprocess.Popen] = []

    def start(directory: Path) -> tuple[subprocess.Popen, str]:
        proc, name = _start_holder(directory)
        started.append(proc)
        return proc, name

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_killed_process_is_gone_even_while_its_forked_child_lives(tmp_path, start_holder):
    locks = LivenessLocks()
    holder, name = start_holder(tmp_path)
    child = (tmp_path / "child").read_text()
    assert child and child != name  # the child's lock is its own, not its parent's
    try:
        assert not is_gone(tmp_path, name, locks)  # locked: alive
    finally:
        _kill(holder)
    assert is_gone(tmp_path, name, locks)  # the forked child does not hold the parent's lock
    assert not is_gone(tmp_path, child, locks)
    # Rank 0's first save clears the files of ended processes, not those of live ones.
    assert LivenessLocks().hold(tmp_path, sweep=True)
    left = {p.name for p in (tmp_path / ALIVE_DIR).iterdir()}
    assert name not in left and child in left


def test_doubt_never_counts_as_gone(tmp_path):
    locks = LivenessLocks()
    mine = locks.hold(tmp_path)
    assert mine == f"{socket.gethostname()}-{os.getpid()}"
    assert locks.hold(tmp_path) == mine  # held once per process
    assert not is_gone(tmp_path, mine, locks)  # our own lock never conflicts with us
    assert not is_gone(tmp_path, None, locks)  # that rank could not take one
    assert not is_gone(tmp_path, "elsewhere-123", locks)  # no such file: not shared
    # An unlocked file naming a process that runs here (a lock lost without its process
    # ending: seen from another holder in this process, the lock is not in the way) is not a
    # death either; one naming a process that has ended is.
    assert not is_gone(tmp_path, mine, LivenessLocks())
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / ALIVE_DIR / f"{socket.gethostname()}-{ended}").touch()
    assert is_gone(tmp_path, f"{socket.gethostname()}-{ended}", locks)


def _rank0_save(tmp_path: Path, timeout: float, alive: list[str | None]) -> BackgroundSave:
    final = tmp_path / "step_000000000001"
    staging = tmp_path / ".staging-step_000000000001"
    staging.mkdir()

    def attempt(fn):
        try:
            return fn(), None
        except Exception as exc:  # noqa: BLE001 - what the Checkpointer does too
            return None, str(exc)

    return BackgroundSave(staging, final, 0, 2, {"state.pt": {"w": torch.zeros(4)}},
                          lambda: os.replace(staging, final), timeout, attempt, alive=alive)


@pytest.mark.timeout(60)
def test_rank_0_stops_waiting_once_the_rank_it_waits_for_is_killed(tmp_path, start_holder):
    holder, name = start_holder(tmp_path)
    pending = _rank0_save(tmp_path, timeout=300.0, alive=[None, name])
    time.sleep(0.3)
    assert pending.running()  # rank 1 lives: rank 0 waits for its files
    _kill(holder)
    start = time.monotonic()
    error = pending.join()
    waited = time.monotonic() - start
    assert error is not None and "rank(s) [1] ended before writing their files" in error, error
    assert waited < 30, waited  # the bound was 300 s; the poll is 50 ms
    assert not (tmp_path / ".staging-step_000000000001").exists()
    assert not (tmp_path / "step_000000000001").exists()


@pytest.mark.timeout(60)
def test_a_rank_that_marked_its_files_before_dying_is_not_counted_gone(tmp_path, start_holder):
    holder, name = start_holder(tmp_path)
    pending = _rank0_save(tmp_path, timeout=300.0, alive=[None, name])
    (pending.staging / ".written-rank00001").touch()
    _kill(holder)
    assert pending.join() is None
    assert (tmp_path / "step_000000000001" / "state.pt").exists()


def test_liveness_is_asked_a_few_ranks_at_a_time_in_turn():
    ranks = list(range(1, 41))
    first, last = _in_turn(ranks, -1, 16)
    second, last = _in_turn(ranks, last, 16)
    third, last = _in_turn(ranks, last, 16)
    assert (first, second) == (list(range(1, 17)), list(range(17, 33)))
    assert third == [*range(33, 41), *range(1, 9)] and last == 8
    assert _in_turn([5, 9], 8, 16) == ([9, 5], 5)  # fewer than the batch: all, in turn
