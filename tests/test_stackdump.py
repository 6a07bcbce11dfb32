"""A stuck rank's Python stack next to its name (lockstep.diagnose.stackdump, used by lockstep.diagnose.hang).

Worlds of 2 on gloo: rank 1 stops at step 3, spinning in a Python loop or blocked inside a
collective nobody else joins; rank 0's DDP all-reduce times out, names rank 1, and its error
carries rank 1's Python stack (the function it is stuck in).
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
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.diagnose.hang import CollectiveTimeoutError
from lockstep.diagnose.progress import INTERVAL_ENV_VAR
from lockstep.diagnose.stackdump import StackDump, request_stack, stack_file

TIMEOUT_S = 5.0


@pytest.fixture(autouse=True)
def _fast_heartbeat(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV_VAR, "0.4")


def test_install_request_and_remove_in_this_process():
    dump = StackDump.install()
    try:
        assert dump.active
        stack = request_stack(os.getpid())
        assert stack is not None and "test_install_request_and_remove_in_this_process" in stack
    finally:
        dump.remove()
    assert not os.path.exists(stack_file(os.getpid()))
    assert request_stack(os.getpid()) is None  # nothing installed: no signal is sent


def _spin_in_python_loop(done: Path) -> None:
    deadline = time.monotonic() + 90
    while not done.exists() and time.monotonic() < deadline:
        sum(range(1000))


def _block_in_collective(side: dist.ProcessGroup) -> None:
    # blocked in C++ until rank 0, having named rank 1, joins this all-reduce on the side group
    dist.all_reduce(torch.zeros(1), group=side)


def _stuck_rank(rank: int, mode: str, directory: str) -> str:
    lockstep.init_distributed(timeout=timedelta(seconds=TIMEOUT_S))
    model = lockstep.DistributedDataParallel(nn.Linear(4, 1))
    side = dist.new_group([0, 1], timeout=timedelta(seconds=90))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    done = Path(directory, "done-0")
    out = "no error"
    try:
        for step in range(1, 6):
            if rank == 1 and step == 3:
                if mode == "python":
                    _spin_in_python_loop(done)
                else:
                    _block_in_collective(side)
                break
            model(torch.ones(2, 4)).sum().backward()
    except CollectiveTimeoutError as exc:
        out = str(exc)
        done.touch()
        if mode == "collective":
            dist.all_reduce(torch.zeros(1), group=side)  # releases rank 1
    if rank == 0:  # hosts the store: stay until rank 1 has left its stuck call
        deadline = time.monotonic() + 60
        while not Path(directory, "done-1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        Path(directory, "done-1").touch()
    return out


@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode, function", [("python", "_spin_in_python_loop"),
                                            pytest.param("collective", "_block_in_collective", marks=pytest.mark.slow)])
def test_stuck_rank_stack_is_shown_next_to_its_name(tmp_path, mode, function):
    error = lockstep.spawn(_stuck_rank, 2, (mode, str(tmp_path)), timeout=150)[0]
    assert "rank 1 on" in error and "did not arrive: it is alive but stuck" in error, error
    assert "Python stack of rank 1 (pid " in error, error
    stack = error.split("Python stack of rank 1", 1)[1]
    assert function in stack and "_stuck_rank" in stack, error


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_launcher_root_cause_shows_the_hung_rank_stack(tmp_path):
    script = Path(__file__).parent / "scripts" / "hang_ddp.py"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2", str(script), "sleep",
         "1", str(TIMEOUT_S)], check=False, capture_output=True, text=True, timeout=150,
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", INTERVAL_ENV_VAR: "0.4"})
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    report = err[err.index("Root cause: rank 1 "):]
    # what test_hangs.py's launcher case (now in the slow tier) checks, on this same run
    assert "Root cause: rank 1 (local rank 1, pid " in err, err[-3000:]
    assert ("hung at step 3, phase 'after forward, before backward': its peers waited for it in "
            "vain (named by rank(s) 0") in err, err[-3000:]
    assert "the launcher then stopped it (SIGTERM)." in err
    assert "reported: DDP gradient all-reduce (bucket 0 of 1) failed after waiting" in err
    stack = report[report.index("Python stack of rank 1 (pid "):]
    assert "hang_ddp.py" in stack and "in main" in stack, report
