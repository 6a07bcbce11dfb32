"""Misuse and exit paths that used to fail silently, late or with someone else's error.

Tiers: pure logic (argument checks, failure ordering, payload packing) in this process; worlds
of two through ``lockstep.spawn`` for the checkpoint disagreements; ``lockstep run`` for the
exit of a finished job (no abort at interpreter exit) and for a notebook-style ``spawn``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)

import lockstep
from lockstep.checkpoint import Checkpointer, CheckpointError
from lockstep.cli import main as cli_main
from lockstep.launcher import errors
from lockstep.launcher.launch_plan import LaunchPlan

SCRIPTS = Path(__file__).parent / "scripts"
RUN_TIMEOUT_S = 180


# ------------------------------------------------------------------ arguments checked up front


def test_runtime_wrap_refuses_a_function():
    def build_model() -> nn.Module:
        return nn.Linear(2, 2)

    with lockstep.Runtime() as rt:
        with pytest.raises(TypeError, match=(
            r"Runtime.wrap expects a torch.nn.Module, got function "
            r"'test_runtime_wrap_refuses_a_function.<locals>.build_model'"
        )):
            rt.wrap(build_model)
        with pytest.raises(TypeError, match=r"got type 'Linear'.*not a function or class"):
            rt.wrap(nn.Linear)


def test_sampler_refuses_a_string_world_size():
    data = list(range(8))
    with pytest.raises(TypeError, match=r"num_replicas must be an int, got str '2' \(pass num_replicas=2\)"):
        lockstep.DistributedSampler(data, num_replicas="2", rank=0)
    with pytest.raises(TypeError, match=r"rank must be an int, got float 1.0"):
        lockstep.DistributedSampler(data, num_replicas=2, rank=1.0)


def test_checkpointer_refuses_a_string_timeout(tmp_path):
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds .*got str '10'"):
        Checkpointer(tmp_path, timeout="10")
    with pytest.raises(TypeError, match=r"directory must be a path .*got int 5"):
        Checkpointer(5)


def test_checkpointer_on_a_regular_file_says_so(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"ckpt is a file, not a directory"):
        Checkpointer(path).restore(model=nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"ckpt is a file, not a directory"):
        Checkpointer(path).save(1, model=nn.Linear(2, 2))


def test_checkpointer_one_level_too_deep_says_so(tmp_path):
    model = nn.Linear(2, 2)
    step_dir = Checkpointer(tmp_path).save(3, model=model)
    with pytest.raises(CheckpointError, match=(
        r"step_000000000003 is a single checkpoint, not a checkpoint directory: pass its parent"
    )):
        Checkpointer(step_dir).restore(model=model)


def test_local_ranks_filter_outside_the_job_is_refused(capsys):
    job = SCRIPTS / "launcher" / "job.py"
    argv = ["run", "--nproc-per-node", "2", "--local-ranks-filter", "7", str(job)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--local-ranks-filter 7: local rank(s) [7] are not in this job" in err
    assert "0-1 (--nproc-per-node 2)" in err


def test_launch_plan_built_by_hand_is_validated():
    base = {
        "nproc_per_node": 2, "min_nodes": 1, "max_nodes": 1, "node_rank": 0, "rdzv_backend": "static",
        "rdzv_endpoint": "127.0.0.1:0", "run_id": "x", "max_restarts": 0, "monitor_interval": 0.1,
        "entrypoint": "python", "args": (),
    }
    LaunchPlan(**base)
    for change, message in [
        ({"nproc_per_node": 0}, "--nproc-per-node 0: a machine needs at least 1 worker"),
        ({"max_restarts": -1}, "--max-restarts -1: must be 0 or more"),
        ({"node_rank": 3}, r"--node-rank 3 is outside \[0, 1\)"),
        ({"local_ranks_filter": frozenset({0, 5})}, r"local rank\(s\) \[5\] are not in this job"),
        ({"min_nodes": 2}, "--nnodes 2:1: need 1 <= MIN <= MAX"),
    ]:
        with pytest.raises(ValueError, match=message):
            LaunchPlan(**{**base, **change})
    with pytest.raises(TypeError, match="LaunchPlan.nproc_per_node must be an int, got '2'"):
        LaunchPlan(**{**base, "nproc_per_node": "2"})


# ------------------------------------------------------------------ every rank raises


def _error_file(path: Path, message: str, timestamp: int) -> str:
    callstack = f'Traceback (most recent call last):\n  File "train.py", line 3\n{message}\n'
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)}}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def test_every_rank_raises_root_cause_is_the_exception(tmp_path):
    """Rank 0 raised first, but the launcher's SIGTERM (for rank 1's failure) ended it."""
    t = int(time.time())
    first = _error_file(tmp_path / "0" / "error.json", "ValueError: rank 0 fails", t - 1)
    second = _error_file(tmp_path / "1" / "error.json", "ValueError: rank 1 fails", t)
    err = ChildFailedError("train.py", {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=first),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=second),
    })
    failures = errors.failures_from(err)
    report = errors.format_report(failures)
    assert "Root cause: rank 0 (local rank 0, pid 10) ended with exit code 1." in report
    assert "ValueError: rank 0 fails" in report and "SIGTERM" not in report
    assert errors.exit_code_for(failures[0]) == 1


# ------------------------------------------------------------------ checkpoint disagreements


def _different_steps(rank: int, directory: str) -> list[str]:
    lockstep.init_distributed()
    out = []
    model = nn.Linear(2, 2)
    for step, objects in ((5 + rank, {"model": model}),  # then: rank 1 adds its optimizer
                          (7, {"model": model, **({"optimizer": torch.optim.SGD(
                              model.parameters(), lr=0.1)} if rank else {})})):
        try:
            Checkpointer(directory, timeout=60).save(step, **objects)
            out.append("saved")
        except CheckpointError as exc:
            out.append(str(exc))
    return out


def _different_directories(rank: int, directory: str) -> str:
    lockstep.init_distributed()
    try:
        Checkpointer(os.path.join(directory, f"r{rank}"), timeout=60).save(1, model=nn.Linear(2, 2))
    except CheckpointError as exc:
        return str(exc)
    return "saved"


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_save_with_a_different_step_per_rank_names_them(tmp_path):
    for steps, names in lockstep.spawn(_different_steps, 2, args=(str(tmp_path),), timeout=100):
        assert "the ranks passed different steps (rank 0: 5, rank 1: 6)" in steps
        # Different objects: rank 1's optimizer was dropped silently (rank 0's names written).
        assert ("the ranks passed different objects (rank 0: ['model'], rank 1: ['model', "
                "'optimizer'])") in names
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_save_with_a_different_directory_per_rank_says_so(tmp_path):
    for message in lockstep.spawn(_different_directories, 2, args=(str(tmp_path),), timeout=100):
        assert "the ranks use different directories" in message
        assert f"rank 0: '{tmp_path / 'r0'}', rank 1: '{tmp_path / 'r1'}'" in message


# ------------------------------------------------------------------ spawn from a notebook


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_spawn_from_an_interactive_session():
    """A notebook cell's function (``__main__`` without a file) runs, and its errors come back."""
    code = """
import torch, lockstep
SCALE = 3.0
def helper(x):
    return x * SCALE
def work(rank, offset):
    lockstep.init_distributed()
    t = torch.ones(1) * helper(rank + offset)
    torch.distributed.all_reduce(t)
    return t.item()
print("values", lockstep.spawn(work, 2, args=(1,)))
def fails(rank):
    raise ValueError(f"rank {rank} says no")
try:
    lockstep.spawn(fails, 2)
except lockstep.WorkerError as exc:
    print("error", exc)
class Net(torch.nn.Module):
    pass
def builds(rank):
    return Net()
try:
    lockstep.spawn(builds, 2)
except TypeError as exc:
    print("refused", exc)
"""
    env = {**os.environ, "LOCKSTEP_START_METHOD": "spawn"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=180, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "values [9.0, 9.0]" in out.stdout
    assert re.search(r"rank (\d) raised ValueError: rank \1 says no", out.stdout)
    assert 'File "<string>"' in out.stdout  # the worker's own traceback, not an exit code
    assert "class 'Net' is defined in this interactive session" in out.stdout
    assert "define it in a module file" in out.stdout


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_spawn_unguarded_at_a_scripts_top_level_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import lockstep\ndef work(rank):\n    return rank\nlockstep.spawn(work, 2)\n")
    out = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert "lockstep.spawn is called at the top level of" in out.stderr
    assert 'without `if __name__ == "__main__":`' in out.stderr


# ------------------------------------------------------------------ a finished job exits 0


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_finished_jobs_without_teardown_exit_cleanly(tmp_path):
    """The README's DDP script, no teardown, several times: never an abort at exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2",
               str(SCRIPTS / "readme_ddp.py")]
    for _ in range(5):
        out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                             env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "rank 0 finished" in out.stdout and "rank 1 finished" in out.stdout


def test_teardown_leaves_no_gloo_thread_busy():
    """After shutdown_distributed, no gloo worker thread can still need the GIL."""
    from lockstep.teardown import backend_threads, quiesce

    lockstep.init_distributed()
    model = lockstep.DistributedDataParallel(nn.Linear(3, 2))
    model(torch.randn(4, 3)).sum().backward()
    lockstep.shutdown_distributed()
    assert quiesce(timeout=5.0)
    assert backend_threads() is not None
    del model
