"""Hang detection and the collective debug mode (lockstep.diagnose.watchdog, lockstep.diagnose.collective_checks).

Tiers: signature comparison as pure logic; one world of 3 on gloo in which ranks disagree on
collectives (debug mode) and then rank 1 never joins one, twice (debug mode and plain); a job
under ``lockstep run`` whose stuck rank is reported as the root cause (not the rank that
waited for it) and stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import wait_for_files

import lockstep
from lockstep.diagnose.collective_checks import (
    DEBUG_ENV_VAR,
    CollectiveMismatchError,
    check_collective,
    debug_collectives_enabled,
    describe_mismatch,
    signature,
)
from lockstep.diagnose.watchdog import CollectiveTimeoutError, CollectiveWatchdog

HANG_TIMEOUT_S = 3.0


def test_signature_and_mismatch_description():
    sig = signature("all_reduce", [torch.zeros(4, 3), torch.zeros(2, dtype=torch.int64)])
    assert sig == "all_reduce(float32[4, 3] cpu, int64[2] cpu)"
    same = ["all_reduce(float32[4] cpu)"] * 3
    assert describe_mismatch(same) is None
    odd = describe_mismatch(same[:2] + ["all_reduce(float32[5] cpu)"], ranks=[0, 4, 8])
    assert odd.startswith("ranks disagree on the next collective: rank 8 calls all_reduce(float32[5] cpu);")
    assert "while ranks [0, 4] call all_reduce(float32[4] cpu)" in odd
    # A tie (world of 2) keeps rank 0's call as the reference.
    tie = describe_mismatch(["barrier()", "broadcast(src=0)(float32[1] cpu)"])
    assert "rank 1 calls broadcast(src=0)(float32[1] cpu); while ranks [0] call barrier()" in tie


def test_debug_switch_and_argument_errors():
    assert debug_collectives_enabled({DEBUG_ENV_VAR: "1"})
    assert debug_collectives_enabled({DEBUG_ENV_VAR: " On "})
    assert not debug_collectives_enabled({DEBUG_ENV_VAR: "0"})
    assert not debug_collectives_enabled({})
    with pytest.raises(RuntimeError, match=r"needs a process group: call lockstep.init_distributed\(\)"):
        CollectiveWatchdog()
    lockstep.init_distributed()
    try:
        with pytest.raises(ValueError, match="timeout must be positive seconds, got -1"):
            CollectiveWatchdog(timeout=-1)
        watchdog = CollectiveWatchdog(timeout=timedelta(seconds=5), debug=True)
        value = torch.tensor([2.0])
        watchdog.all_reduce(value)  # a world of one: runs, checks, nothing to wait for
        watchdog.barrier()
        check_collective("all_reduce", [value])
        assert value.item() == 2.0
    finally:
        lockstep.shutdown_distributed()


def _catch(fn) -> str:
    try:
        fn()
    except (CollectiveMismatchError, CollectiveTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _hang_after_disagreeing(rank: int, directory: str) -> dict:
    os.environ[DEBUG_ENV_VAR] = "1"  # this worker process only
    lockstep.init_distributed()
    out: dict = {}
    checked = CollectiveWatchdog(name="debug", timeout=30)
    assert checked.debug
    total = torch.tensor([float(rank)])
    checked.all_reduce(total)
    checked.broadcast(source := torch.tensor([float(rank)]), src=0)
    out["sum"], out["bcast"] = total.item(), source.item()
    shape = (5,) if rank == 2 else (4,)
    out["shape"] = _catch(lambda: checked.all_reduce(torch.zeros(shape)))
    call = (lambda: checked.barrier()) if rank == 1 else (lambda: checked.all_reduce(torch.zeros(4)))
    out["call"] = _catch(call)
    dtype = torch.float64 if rank == 0 else torch.float32
    out["check"] = _catch(lambda: check_collective("all_gather", [torch.zeros(2, dtype=dtype)]))
    # Rank 1 never joins: first while the ranks compare signatures, then in a plain all-reduce.
    for phase, debug in (("compare", True), ("plain", False)):
        watchdog = CollectiveWatchdog(name=phase, timeout=HANG_TIMEOUT_S, debug=debug)
        markers = [Path(directory, f"{phase}-{r}") for r in (0, 2)]
        if rank == 1:
            wait_for_files(markers)
            continue
        start = time.monotonic()
        out[phase] = _catch(lambda wd=watchdog: wd.all_reduce(torch.ones(3)))
        out[f"{phase}_s"] = time.monotonic() - start
        Path(directory, f"{phase}-{rank}").touch()
        # Rank 0 hosts the store: leaving before rank 2 has asked it who is missing would
        # turn rank 2's answer into "the store is gone".
        wait_for_files(markers)
    return out


@pytest.mark.multirank
def test_disagreements_and_a_missing_rank_are_named(tmp_path):
    results = lockstep.spawn(_hang_after_disagreeing, 3, (str(tmp_path),), timeout=120)
    for rank, out in enumerate(results):
        assert (out["sum"], out["bcast"]) == (3.0, 0.0)
        assert out["shape"] == (
            "CollectiveMismatchError: before all_reduce #3: ranks disagree on the next collective: "
            "rank 2 calls all_reduce(float32[5] cpu); while ranks [0, 1] call "
            "all_reduce(float32[4] cpu). Every rank must issue the same collectives in the same "
            "order on tensors of the same shape and dtype (look for rank-dependent branches or "
            "uneven data)."
        )
        assert "rank 1 calls barrier(); while ranks [0, 2] call all_reduce(float32[4] cpu)" in out["call"]
        assert "rank 0 calls all_gather(float64[2] cpu); while ranks [1, 2] call" in out["check"]
        if rank == 1:
            continue
        for phase in ("compare", "plain"):
            assert out[phase].startswith(
                f"CollectiveTimeoutError: rank {rank}: all_reduce #1 did not complete within 3s: "
                "rank(s) [1] did not arrive (rank 1 entered no watched collective)."
            ), out[phase]
            # Far below the process group's 10-minute default; loose because the CPU is shared.
            assert out[f"{phase}_s"] < HANG_TIMEOUT_S + 20, out


@pytest.mark.multirank
def test_launcher_stops_a_job_with_a_stuck_rank_and_names_it(tmp_path):
    script = Path(__file__).parent / "scripts" / "hang_train.py"
    command = [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2", str(script),
               "--timeout", str(HANG_TIMEOUT_S)]
    start = time.monotonic()
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    # The stuck rank is the root cause, not rank 0 that waited for it (issue 11, item 2).
    assert "Root cause: rank 1 (local rank 1, pid " in done.stderr, done.stderr[-3000:]
    assert "hung: its peers waited for it in vain (named by rank(s) 0); the launcher then " \
        "stopped it (SIGTERM)." in done.stderr, done.stderr[-3000:]
    assert (
        "rank 0 reported: all_reduce #2 did not complete within 3s: rank(s) [1] "
        "did not arrive (rank 1 last entered all_reduce #1)"
    ) in done.stderr
    assert done.returncode == 1
    # Rank 1 sleeps for an hour: only the launcher stopping it ends the job this soon.
    assert elapsed < 100, elapsed
