"""A rank that stops is named by the ranks that wait for it (lockstep.diagnose.progress, lockstep.diagnose.hang).

Tiers: the blame verdicts turned into a root cause, as pure logic; worlds of 2 and 3 on gloo in
which one rank sleeps before backward, leaves the loop early, or stops inside ``join()`` or
before a ``Checkpointer`` meeting, where every waiting rank must name it (and what it was last
doing) shortly after the process group's timeout; jobs under ``lockstep run`` whose root cause
must be the rank that stopped, not the ones that waited nor the one the launcher ended, and a
job in which one rank skipped a collective and gloo aborted a peer, whose root cause must be the
rank that skipped (lockstep.diagnose.abort_guard).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import wait_for_files
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)

import lockstep
import lockstep.helper
from lockstep.checkpoint import CheckpointError
from lockstep.diagnose.hang import BLAME_FILE, CollectiveTimeoutError, write_blame
from lockstep.diagnose.progress import INTERVAL_ENV_VAR, publish_interval
from lockstep.launcher.errors import exit_code_for, failures_from, format_report

TIMEOUT_S = 5.0  # short, yet long enough for a loaded machine to start a step
# Generous: the CPU is shared. Still far below the 10-minute default the naming replaces.
NAMED_WITHIN_S = TIMEOUT_S + 20
HOST = socket.gethostname()
SCRIPT = Path(__file__).parent / "scripts" / "hang_ddp.py"


@pytest.fixture(autouse=True)
def _fast_heartbeat(monkeypatch):
    # Peers' liveness is judged by their next heartbeat: keep the tests quick.
    monkeypatch.setenv(INTERVAL_ENV_VAR, "0.4")


# ---- pure logic: the launcher's root cause ------------------------------------------------------
def _failure(tmp_path: Path, rank: int, exitcode: int, message: str = "") -> ProcessFailure:
    folder = tmp_path / str(rank)
    folder.mkdir()
    error_file = folder / "error.json"
    if message:
        payload = {"message": message,
                   "extraInfo": {"py_callstack": f"Traceback\n{message}", "timestamp": "1"}}
        error_file.write_text(json.dumps({"message": payload}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                          error_file=str(error_file))


def _named_each_other(tmp_path, monkeypatch, summaries, verdicts):
    """Ranks 0 and 1 both failed (exit 1, ``summaries``), each leaving its verdict."""
    files = [_failure(tmp_path, rank, 1, summary) for rank, summary in enumerate(summaries)]
    for rank, (culprit, message) in enumerate(verdicts):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[rank].error_file)
        write_blame(rank, [culprit], message)
    return failures_from(ChildFailedError("job", dict(enumerate(files))))


def test_blamed_rank_is_the_root_cause_not_the_one_that_waited(tmp_path, monkeypatch):
    waited = _failure(tmp_path, 0, 1, "CollectiveTimeoutError: rank 0: bucket failed")
    stopped = _failure(tmp_path, 1, -15)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", waited.error_file)
    write_blame(0, [{"rank": 1, "state": "stuck", "step": 3, "phase": "backward"}],
                "rank 0: DDP gradient all-reduce failed: rank 1 did not arrive")
    error = ChildFailedError("job", {0: waited, 1: stopped})
    failures = failures_from(error)
    assert [f.rank for f in failures] == [1, 0]
    report = format_report(failures)
    assert ("Root cause: rank 1 (local rank 1, pid 101) hung at step 3, phase 'backward': its "
            "peers waited for it in vain (named by rank(s) 0); the launcher then stopped it "
            "(SIGTERM).") in report
    assert "rank 0 reported: DDP gradient all-reduce failed: rank 1 did not arrive" in report
    assert exit_code_for(failures[0]) == 1
    assert (tmp_path / "0" / BLAME_FILE).exists()


def test_a_rank_that_skipped_a_checkpointer_call_is_the_root_cause(tmp_path, monkeypatch):
    """save() on rank 0 only: rank 0 waits in the meeting and names rank 1, rank 1 runs on into
    the next all-reduce and names rank 0. The tie went to the lowest rank (rank 0, innocent);
    the meeting's evidence now decides."""
    failures = _named_each_other(
        tmp_path, monkeypatch,
        ["CheckpointError: rank 0 waited 8s in Checkpointer.save",
         "CollectiveTimeoutError: rank 1: all-reduce failed"],
        [({"rank": 1, "state": "stuck", "step": 4, "phase": "backward",
           "meeting": "Checkpointer.save(step=4)"}, "rank 0: rank(s) [1] never called it"),
         ({"rank": 0, "state": "stuck", "step": 4, "phase": "after backward"},
          "rank 1: rank 0 did not arrive")])
    assert failures[0].rank == 1
    assert ("Root cause: rank 1 (local rank 1, pid 101) never called Checkpointer.save(step=4), "
            "which its peers waited in at step 4, phase 'backward' (named by rank(s) 0)"
            ) in format_report(failures)


def test_rank_that_exited_early_is_the_root_cause(tmp_path, monkeypatch):
    waited = _failure(tmp_path, 0, 1, "CollectiveTimeoutError: rank 0: bucket failed")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", waited.error_file)
    write_blame(0, [{"rank": 2, "state": "exited", "local_rank": 2, "pid": 7, "step": 2,
                     "phase": "after backward"}], "rank 0: rank 2 exited")
    failures = failures_from(ChildFailedError("job", {0: waited}))
    assert failures[0].rank == 2 and failures[0].exitcode == 0
    assert ("Root cause: rank 2 (local rank 2, pid 7) left early: it exited at step 2, phase "
            "'after backward' while its peers waited for it (named by rank(s) 0).") in (
        format_report(failures))
    assert exit_code_for(failures[0]) == 1


def test_a_rank_on_another_machine_is_not_said_to_have_exited(tmp_path, monkeypatch):
    """This launcher cannot see how a rank of another machine ended: it may be that machine
    that was lost (until 2026-11-29 the report said "left early: it exited")."""
    waited = _failure(tmp_path, 0, 1, "CollectiveTimeoutError: rank 0: bucket failed")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", waited.error_file)
    write_blame(0, [{"rank": 2, "state": "exited", "local_rank": 0, "pid": 7, "step": 2,
                     "phase": "after backward", "host": "host-b"}], "rank 0: rank 2 exited")
    report = format_report(failures_from(ChildFailedError("job", {0: waited})))
    assert ("rank 2 (local rank 0, pid 7) stopped on host-b at step 2, phase 'after backward' "
            "while its peers waited for it: its process ended or that machine was lost") in report


def test_a_blamed_rank_that_raised_failed_and_did_not_hang(tmp_path, monkeypatch):
    # The watchdog names missing ranks as "stuck"; one that raised its own error is not hung.
    waited = _failure(tmp_path, 0, 1, "CollectiveTimeoutError: rank 0: all_reduce timed out")
    crashed = _failure(tmp_path, 1, 1, "ValueError: bad batch")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", waited.error_file)
    write_blame(0, [{"rank": 1, "state": "stuck"}], "rank 0: rank(s) [1] did not arrive")
    failures = failures_from(ChildFailedError("job", {0: waited, 1: crashed}))
    report = format_report(failures)
    assert ("Root cause: rank 1 (local rank 1, pid 101) failed with an error of its own while "
            "its peers waited for it (named by rank(s) 0)") in report
    assert "ValueError: bad batch" in report


def test_a_rank_its_peers_name_without_pid_or_local_rank_shows_neither(tmp_path, monkeypatch):
    waited = _failure(tmp_path, 0, 1, "CollectiveTimeoutError: rank 0: all_reduce timed out")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", waited.error_file)
    write_blame(0, [{"rank": 1, "state": "stuck"}], "rank 0: rank(s) [1] did not arrive")
    report = format_report(failures_from(ChildFailedError("job", {0: waited})))
    assert "Root cause: rank 1 left early" in report and "-1" not in report


def test_an_error_file_without_a_traceback_shows_its_message(tmp_path):
    failure = _failure(tmp_path, 0, 1, "CollectiveMismatchAbort: rank 1 entered 3")
    payload = json.loads(Path(failure.error_file).read_text())
    payload["message"]["extraInfo"]["py_callstack"] = "NoneType: None\n"  # never raised
    Path(failure.error_file).write_text(json.dumps(payload))
    report = format_report(failures_from(ChildFailedError("job", {0: failure})))
    assert "NoneType: None" not in report and "rank 1 entered 3" in report


def test_every_rank_raising_reports_an_exception_not_the_agents_sigterm(tmp_path):
    # Rank 0 raised first but was still exiting when the agent stopped everyone (SIGTERM).
    first = _failure(tmp_path, 0, -15, "ValueError: bad batch")
    later = _failure(tmp_path, 1, 1, "ValueError: bad batch")
    failures = failures_from(ChildFailedError("job", {0: first, 1: later}))
    # Either rank may come first (both raised); never the agent's SIGTERM, always exit code 1.
    assert {f.rank for f in failures} == {0, 1}
    assert "ValueError: bad batch" in failures[0].summary
    assert exit_code_for(failures[0]) == 1


def test_without_blame_the_order_is_unchanged(tmp_path):
    own = _failure(tmp_path, 0, 1, "ValueError: bad batch")
    echo = _failure(tmp_path, 1, -15)
    failures = failures_from(ChildFailedError("job", {0: own, 1: echo}))
    assert [f.rank for f in failures] == [0, 1] and not failures[0].blame


# ---- worlds of 2 and 3 ----------------------------------------------------------------------------
class _Stopped(Exception):
    """The culprit leaves ``join()`` without shadowing its peers (it is the one that hung)."""


def _stop_in_training(rank: int, world: int, mode: str, culprit: int, directory: str) -> dict:
    lockstep.init_distributed(timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Start the steps together: on a loaded machine, set-up alone can outlast the short timeout.
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    others = [Path(directory, f"done-{r}") for r in range(world) if r != culprit]
    out: dict = {"error": "no error"}
    start = time.monotonic()
    try:
        with model.join(enable=mode == "join"):
            for step in range(1, 6):
                if rank == culprit and step == 3:
                    if mode == "leave":
                        return out  # uneven data: exits with 0 while the others go on
                    if mode == "raise":  # an error of its own, the group shut in a finally:
                        try:
                            try:
                                raise ValueError("bad batch at step 3")
                            finally:
                                lockstep.shutdown_distributed()
                        except ValueError:
                            return out
                    if mode == "join":
                        wait_for_files(others)  # stuck before its forward, inside join()
                        raise _Stopped
                loss = model(torch.ones(2, 4)).sum()
                if rank == culprit and step == 3:
                    wait_for_files(others)  # stuck between forward and backward
                    return out
                start = time.monotonic()
                loss.backward()
                opt.step()
                opt.zero_grad()
    except _Stopped:
        return out
    except CollectiveTimeoutError as exc:
        out = {"error": str(exc), "missing": exc.missing_ranks, "op": exc.op,
               "elapsed": time.monotonic() - start}
    Path(directory, f"done-{rank}").touch()
    # Rank 0 hosts the store: it stays until every waiting rank has read its peers' records.
    if rank == 0:
        wait_for_files(others)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world,culprit", [(2, 0), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_rank_sleeping_before_backward_is_named_by_every_waiting_rank(tmp_path, world, culprit):
    results = lockstep.spawn(_stop_in_training, world, (world, "sleep", culprit, str(tmp_path)),
                             timeout=120)
    for rank, out in enumerate(results):
        if rank == culprit:
            continue
        assert out["missing"] == [culprit], out
        assert out["error"].startswith(
            f"rank {rank}: DDP gradient all-reduce (bucket 0 of 1) failed after waiting "), out
        assert (
            f"rank {culprit} on {HOST} did not arrive: it is alive but stuck at step 3, phase "
            f"'after forward, before backward', last collective #5 DDP gradient all-reduce "
            "(bucket 0)"
        ) in out["error"], out
        assert f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in out["error"]
        assert out["elapsed"] < NAMED_WITHIN_S, out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_rank_leaving_the_loop_early_is_named(tmp_path, world):
    culprit = world - 1
    results = lockstep.spawn(_stop_in_training, world, (world, "leave", culprit, str(tmp_path)),
                             timeout=120)
    for rank, out in enumerate(results[:culprit]):
        assert out["missing"] == [culprit], out
        assert (
            f"rank {culprit} on {HOST} exited while its peers still needed it, at step 2, phase "
            "'after backward (optimizer step, data loading, next forward)'"
        ) in out["error"], out
        assert "left the training loop early" in out["error"]
        assert out["elapsed"] < NAMED_WITHIN_S, out


@pytest.mark.multirank
def test_rank_that_raised_is_named_as_failed_not_as_leaving_early(tmp_path):
    """The waiting rank said the culprit "left the training loop early (uneven data?)" when
    it had raised an error of its own; its record now says so, with the error."""
    results = lockstep.spawn(_stop_in_training, 2, (2, "raise", 1, str(tmp_path)), timeout=120)
    out = results[0]
    assert out["missing"] == [1], out
    assert (f"rank 1 on {HOST} failed with an error of its own at step 2, phase 'after backward "
            "(optimizer step, data loading, next forward)'") in out["error"], out
    assert "(ValueError: bad batch at step 3)" in out["error"] and "uneven data" not in out["error"]


def _zero_under_join(rank: int, directory: str) -> dict:
    """Rank 1 runs out of data under DDP's join(), which cannot stand in for the ZeRO step."""
    lockstep.init_distributed(timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Linear(3, 2))
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    out: dict = {"error": "no error"}
    try:
        with model.join():
            for step in range(3 if rank == 0 else 2):
                opt.zero_grad()
                model(torch.ones(2, 3) * (step + 1)).sum().backward()
                opt.step()
    except CollectiveTimeoutError as exc:
        out = {"error": str(exc), "missing": exc.missing_ranks}
    Path(directory, f"done-{rank}").touch()
    if rank == 0:
        wait_for_files([Path(directory, "done-1")])
    return out


@pytest.mark.multirank
def test_ranks_in_different_collectives_at_the_same_count_say_so(tmp_path):
    """Until 2026-11-29 rank 1 blamed rank 0 (the one with more data) for "leaving the loop
    early", and rank 0 got gloo's bare timeout."""
    results = lockstep.spawn(_zero_under_join, 2, (str(tmp_path),), timeout=120)
    for rank, out in enumerate(results):
        other = 1 - rank
        assert out.get("missing") == [other], out
        assert (f"rank {other} on {HOST} entered this collective's number too, but in another "
                "collective: ") in out["error"], out
        assert "ZeroRedundancyOptimizer is not a Joinable" in out["error"]
    assert "DDP join announcement (this rank is in ZeRO parameter broadcast" in results[0]["error"]


@pytest.mark.slow
@pytest.mark.multirank
def test_rank_stuck_inside_join_is_named(tmp_path):
    results = lockstep.spawn(_stop_in_training, 3, (3, "join", 2, str(tmp_path)), timeout=120)
    for out in results[:2]:
        assert out["missing"] == [2] and out["op"] == "DDP join announcement", results
        assert (f"rank 2 on {HOST} did not arrive: it is alive but stuck at step 2, phase "
                "'after backward (optimizer step, data loading, next forward)'") in out["error"]


def _skip_a_save(rank: int, directory: str) -> str:
    lockstep.init_distributed(timeout=timedelta(seconds=30))
    ckpt = lockstep.Checkpointer(Path(directory, "ckpt"), timeout=TIMEOUT_S)
    done = Path(directory, "done-0")
    if rank == 1:
        wait_for_files([done])  # never calls save()
        return ""
    try:
        ckpt.save(1, model=nn.Linear(2, 2))
        return "no error"
    except CheckpointError as exc:
        return str(exc)
    finally:
        done.touch()


@pytest.mark.multirank
def test_rank_missing_a_checkpointer_meeting_is_named_with_where_it_is(tmp_path):
    message = lockstep.spawn(_skip_a_save, 2, (str(tmp_path),), timeout=120)[0]
    assert "for rank(s) [1], which never called it" in message, message
    assert (f"Where they are: rank 1 on {HOST} did not arrive: it is alive but stuck at step 0, "
            "phase 'started'") in message, message
    # Its Python stack comes with it, as a collective's timeout gives it (it had none).
    assert "Python stack of rank 1 (pid" in message and "wait_for_files" in message, message


# ---- under lockstep run ---------------------------------------------------------------------------
def _launch(tmp_path: Path, world: int, mode: str, culprit: int, **env: str):
    command = [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", str(world),
               str(SCRIPT), mode, str(culprit), str(TIMEOUT_S)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    return done.returncode, done.stderr


def test_heartbeat_interval_knob():
    assert publish_interval({}) == 1.0
    assert publish_interval({INTERVAL_ENV_VAR: "0.25"}) == 0.25
    with pytest.raises(ValueError, match="LOCKSTEP_PROGRESS_INTERVAL='soon': expected a positive"):
        publish_interval({INTERVAL_ENV_VAR: "soon"})


@pytest.mark.slow  # its assertions run in the default tier in test_stackdump.py's launcher case
@pytest.mark.multirank
def test_launcher_names_the_rank_that_hung(tmp_path):
    culprit = 1
    code, err = _launch(tmp_path, 2, "sleep", culprit)
    assert code == 1, err[-3000:]
    assert (f"Root cause: rank {culprit} (local rank {culprit}, pid ") in err, err[-3000:]
    assert ("hung at step 3, phase 'after forward, before backward': its peers waited for it in "
            "vain (named by rank(s) 0") in err, err[-3000:]
    assert "the launcher then stopped it (SIGTERM)." in err
    assert "reported: DDP gradient all-reduce (bucket 0 of 1) failed after waiting" in err


@pytest.mark.slow
@pytest.mark.multirank
def test_launcher_names_the_rank_that_left_early(tmp_path):
    code, err = _launch(tmp_path, 2, "leave", 1)
    assert code == 1, err[-3000:]
    assert ("Root cause: rank 1 (local rank 1, pid ") in err, err[-3000:]
    assert ("left early: it exited at step 2, phase 'after backward (optimizer step, data "
            "loading, next forward)' while its peers waited for it (named by rank(s) 0).") in err


@pytest.mark.slow
@pytest.mark.multirank
def test_launcher_names_the_rank_with_other_shapes_in_debug_mode(tmp_path):
    code, err = _launch(tmp_path, 3, "shapes", 2, LOCKSTEP_DEBUG_COLLECTIVES="1")
    assert code == 1, err[-3000:]
    assert "Root cause: rank 2 (local rank 2, pid " in err, err[-3000:]
    assert "called a different collective than its peers (named by rank(s) " in err
    assert "rank 2 calls all_reduce(float32[5] cpu); while ranks [0, 1] call" in err


@pytest.mark.multirank
def test_launcher_names_the_rank_that_skipped_a_collective_not_the_one_gloo_aborted(tmp_path):
    # Rank 1 skips a DDP backward; its next all-reduce (larger) meets rank 0's gradient
    # all-reduce and gloo aborts rank 0, which was named as the root cause (SIGABRT).
    code, err = _launch(tmp_path, 2, "skip", 1)
    assert code == 1, err[-3000:]
    assert "Root cause: rank 1 (local rank 1, pid " in err, err[-3000:]
    assert ("skipped a collective its peers ran at step 3, phase 'after forward, before "
            "backward': it had entered 7 collectives where they had entered 8 (named by rank(s) 0)"
            ) in err, err[-3000:]
    assert "SIGABRT" not in err.split("lockstep run: the job failed")[-1], err[-3000:]
    assert "rank 0: gloo aborted this process" in err


# ---- collectives outside DDP's buckets -----------------------------------------------------------
def _stop_elsewhere(rank: int, mode: str, directory: str) -> dict:
    """Rank 1 stops where ``mode`` says; rank 0 runs on into the collective it never joins."""
    lockstep.init_distributed(timeout=timedelta(seconds=TIMEOUT_S))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    done = Path(directory, "done-0")
    out: dict = {"error": "no error"}
    start = time.monotonic()
    try:
        if mode == "ddp-start":
            if rank == 1:
                wait_for_files([done])  # stuck before wrapping its model
                return out
            lockstep.DistributedDataParallel(nn.Linear(4, 4))
        elif mode == "fully_shard":
            model = lockstep.fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
            for step in range(1, 4):
                if rank == 1 and step == 2:
                    wait_for_files([done])  # stuck before its second forward
                    return out
                start = time.monotonic()
                model(torch.ones(2, 4)).sum().backward()
        elif mode == "local_sgd":
            net = nn.Linear(4, 1)
            averager = lockstep.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                         sync_every=2)
            for step in range(1, 5):
                if rank == 1 and step == 2:
                    wait_for_files([done])  # stuck before the step that averages
                    return out
                start = time.monotonic()
                net(torch.ones(2, 4)).sum().backward()
                averager.step()
        elif mode == "metrics":
            if rank == 1:
                wait_for_files([done])
                return out
            lockstep.helper.all_reduce_metrics({"loss": 1.0})
    except CollectiveTimeoutError as exc:
        out = {"error": str(exc), "missing": exc.missing_ranks, "op": exc.op,
               "elapsed": time.monotonic() - start}
    if rank == 0:
        done.touch()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("mode,op", [
    ("ddp-start", "DDP start-up parameter check"),
    ("fully_shard", "fully_shard all-gather"),
    pytest.param("local_sgd", "LocalSGD parameter average", marks=pytest.mark.slow),
    pytest.param("metrics", "metric all-reduce (mean)", marks=pytest.mark.slow),
])
def test_rank_stuck_outside_ddp_buckets_is_named(tmp_path, mode, op):
    out = lockstep.spawn(_stop_elsewhere, 2, (mode, str(tmp_path)), timeout=120)[0]
    assert out.get("missing") == [1], out
    assert out["op"] == op, out
    assert f"rank 1 on {HOST} did not arrive: it is alive but stuck at step" in out["error"], out
    assert out["elapsed"] < NAMED_WITHIN_S, out
    if mode == "fully_shard":  # fully_shard tells where a step is (it said step 0, 'started')
        assert ("stuck at step 1, phase 'after backward (optimizer step, data loading, next "
                "forward)'") in out["error"], out


def _stop_a_pipeline_stage(rank: int, culprit: int, directory: str) -> dict:
    """Two pipeline stages; ``culprit`` stops before step 2, its neighbour waits for a message."""
    lockstep.init_distributed(timeout=timedelta(seconds=TIMEOUT_S))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    pipe = lockstep.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), chunks=2,
                             loss_fn=nn.functional.cross_entropy)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    other = Path(directory, f"done-{1 - culprit}")
    out: dict = {"error": "no error"}
    start = time.monotonic()
    try:
        for step in range(1, 4):
            if rank == culprit and step == 2:
                wait_for_files([other])  # stuck: its neighbour's next message never comes
                break
            start = time.monotonic()
            pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
    except CollectiveTimeoutError as exc:
        out = {"error": str(exc), "missing": exc.missing_ranks, "op": exc.op,
               "elapsed": time.monotonic() - start}
    Path(directory, f"done-{rank}").touch()
    if rank == 0:  # rank 0 hosts the store: it stays until its neighbour has read its record
        wait_for_files([Path(directory, "done-1")])
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("culprit,op", [
    (1, "pipeline: receiving gradients from rank 1"),
    pytest.param(0, "pipeline: receiving activations from rank 0", marks=pytest.mark.slow),
])
def test_stuck_pipeline_stage_is_named_by_its_neighbour(tmp_path, culprit, op):
    out = lockstep.spawn(_stop_a_pipeline_stage, 2, (culprit, str(tmp_path)), timeout=120)[1 - culprit]
    assert out.get("missing") == [culprit], out
    assert out["op"] == op, out
    assert f"rank {culprit} on {HOST} did not arrive: it is alive but stuck at step" in out["error"], out
    assert out["elapsed"] < NAMED_WITHIN_S, out


def test_a_silent_rank_whose_process_still_runs_here_is_called_frozen():
    """A rank holding the GIL in native code (or stopped) publishes nothing, like a dead one:
    it was called "gone" (and got no stack); its process still running here says frozen."""
    from lockstep.diagnose.hang import Culprit

    here = {"host": socket.gethostname(), "step": 3, "phase": "backward"}
    frozen = Culprit(1, "gone", {**here, "pid": os.getpid()})
    assert frozen.frozen_here() and frozen.as_dict()["state"] == "frozen"
    assert f"rank 1 on {HOST} is frozen: its process (pid {os.getpid()}) still runs" in frozen.describe(3.0)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = Culprit(1, "gone", {**here, "pid": int(ended.stdout)})
    assert not dead.frozen_here() and dead.as_dict()["state"] == "gone"
    assert "is gone: no sign of life for 3.0s" in dead.describe(3.0)


def test_a_rank_that_gave_up_waiting_is_not_the_root_cause_when_the_late_one_names_it(
        tmp_path, monkeypatch):
    """World 2, rank 1 busy past the timeout: rank 0 gives up and names rank 1 (stuck); rank 1
    arrives just after, finds rank 0 gone and names it (exited). Rank 0 wrote a verdict of its
    own, so it did not leave early: rank 1 is the root cause, and it hung (its own error is the
    knock-on CollectiveTimeoutError, not one of its own). Until 2026-11-29 the tie went to rank
    0, "left early", and the reason said "an error of its own"."""
    failures = _named_each_other(
        tmp_path, monkeypatch,
        ["CollectiveTimeoutError: rank 0: all_reduce timed out",
         "CollectiveTimeoutError: rank 1: rank 0 exited"],
        [({"rank": 1, "state": "stuck", "step": 4, "phase": "forward"},
          "rank 0: rank(s) [1] did not arrive"),
         ({"rank": 0, "state": "exited", "step": 4, "phase": "backward"}, "rank 1: rank 0 exited")])
    assert failures[0].rank == 1
    assert ("Root cause: rank 1 (local rank 1, pid 101) hung at step 4, phase 'forward': its "
            "peers waited for it in vain (named by rank(s) 0)") in format_report(failures)
