"""Asynchronous ``Checkpointer.save``: a consistent snapshot, the waits, errors at the next call."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint import Checkpointer, CheckpointError
from lockstep.checkpoint import io as ckpt_io


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_snapshot_is_taken_when_save_returns(tmp_path):
    """With defer_copy=False, changing the weights right after save() must not change what is
    written (by default, see test_checkpoint_deferred.py, such a change fails the save)."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    expected = _state(model)
    ckpt = Checkpointer(tmp_path, blocking=False, defer_copy=False)
    ckpt.save(1, model=model, optimizer=optimizer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    optimizer.step()
    ckpt.wait()
    fresh = _model(seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert ckpt.restore(model=fresh, optimizer=fresh_opt).step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert ckpt.snapshot_bytes > sum(v.numel() * 4 for v in expected.values())


def test_async_and_blocking_write_the_same_bytes(tmp_path):
    model = _model()
    background = Checkpointer(tmp_path / "a")
    background.save(7, model=model, extra={"lr": 0.1}, blocking=False)
    background.wait()  # the files are read directly, not through restore()
    Checkpointer(tmp_path / "b").save(7, model=model, extra={"lr": 0.1}, blocking=True)
    a = ckpt_io.read_verified(tmp_path / "a" / "step_000000000007" / "state.pt")
    b = ckpt_io.read_verified(tmp_path / "b" / "step_000000000007" / "state.pt")
    assert a["meta"] == b["meta"] and a["extra"] == b["extra"]
    assert all(torch.equal(a["objects"]["model"][k], v) for k, v in b["objects"]["model"].items())


def test_snapshot_buffers_are_reused(tmp_path):
    model = _model()
    ckpt = Checkpointer(tmp_path, keep=1, blocking=False)
    ckpt.save(1, model=model)
    first = {k: v.data_ptr() for k, v in ckpt._snapshot._buffers.items()}
    ckpt.save(2, model=model)
    second = {k: v.data_ptr() for k, v in ckpt._snapshot._buffers.items()}
    ckpt.wait()
    assert first and first == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000000002"]


def test_background_error_surfaces_at_next_call_naming_the_file(tmp_path, monkeypatch):
    model = _model()
    ckpt = Checkpointer(tmp_path, blocking=False)
    ckpt.save(1, model=model, blocking=True)

    def disk_full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_io, "_write_fully", disk_full)
    ckpt.save(2, model=model)  # returns: the write fails in the background
    with pytest.raises(CheckpointError, match=r"step_000000000002 failed on rank 0: cannot write "
                       r".*state\.pt.*disk or quota is full"):
        ckpt.wait()
    monkeypatch.undo()
    assert ckpt.latest() == tmp_path / "step_000000000001"  # the previous one is intact
    assert not any(p.name.startswith(".staging") for p in tmp_path.iterdir())
    ckpt.wait()  # the error was reported once
    ckpt.save(3, model=model)
    ckpt.wait()
    assert ckpt.latest() == tmp_path / "step_000000000003"


def test_saves_are_asynchronous_by_default(tmp_path, monkeypatch):
    model = _model()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.blocking is False
    monkeypatch.setattr(ckpt_io, "_write_fully", _slow_write(ckpt_io._write_fully))
    path = ckpt.save(1, model=model)
    assert not path.exists()  # the write is still running when save() returns
    weights = sum(t.numel() * t.element_size() for t in _state(model).values())
    assert ckpt.snapshot_bytes >= weights  # the weights, plus the RNG states
    ckpt.wait()
    assert path.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value")
def test_the_write_runs_at_the_lowest_cpu_priority(tmp_path, monkeypatch):
    seen: list[tuple[int, int]] = []
    real = ckpt_io._write_fully

    def observed(fd: int, data: bytes) -> None:
        import threading

        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                     os.getpriority(os.PRIO_PROCESS, os.getpid())))
        real(fd, data)

    monkeypatch.setattr(ckpt_io, "_write_fully", observed)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=_model())
    ckpt.wait()
    before = os.getpriority(os.PRIO_PROCESS, os.getpid())
    # The writing thread yields to training; the process (its main thread) keeps its priority.
    assert seen and all(thread == 19 and main == before for thread, main in seen), seen


def _slow_write(real, seconds: float = 0.2):
    def slow(fd: int, data: bytes) -> None:
        time.sleep(seconds)
        real(fd, data)
    return slow


def test_when_busy_skip_drops_saves_while_the_previous_is_written(tmp_path, monkeypatch):
    model = _model()
    ckpt = Checkpointer(tmp_path, when_busy="skip")
    monkeypatch.setattr(ckpt_io, "_write_fully", _slow_write(ckpt_io._write_fully))
    ckpt.save(1, model=model)
    skipped = ckpt.save(2, model=model)  # returns at once: step 1 is still being written
    ckpt.wait()
    assert not skipped.exists() and ckpt.latest() == tmp_path / "step_000000000001"
    ckpt.save(3, model=model, blocking=True)  # a blocking save is never skipped
    assert ckpt.latest() == tmp_path / "step_000000000003"
    with pytest.raises(ValueError, match="when_busy"):
        Checkpointer(tmp_path, when_busy="drop")


def _skip_on_two_ranks(rank: int, directory: str) -> None:
    lockstep.init_distributed()
    if rank == 0:  # only rank 0 writes slowly: rank 1, done with its files, must skip too
        ckpt_io._write_fully = _slow_write(ckpt_io._write_fully, 1.0)  # type: ignore[assignment]
    ckpt = Checkpointer(directory, when_busy="skip")
    ckpt.save(1, model=_model())
    if rank == 1:
        time.sleep(0.5)  # its own write is done by now (rank 0's takes 2 s)
    ckpt.save(2, model=_model())
    ckpt.wait()
    Path(directory, f"latest{rank}").write_text(str(ckpt.latest()))


@pytest.mark.multirank
def test_when_busy_skip_is_decided_by_all_ranks(tmp_path):
    lockstep.spawn(_skip_on_two_ranks, 2, (str(tmp_path),), timeout=120)
    for rank in range(2):
        assert (tmp_path / f"latest{rank}").read_text().endswith("step_000000000001")
    assert not (tmp_path / "step_000000000002").exists()


def _failed_write_then_skip(rank: int, directory: str) -> None:
    lockstep.init_distributed()
    if rank == 0:  # rank 0 is still writing step 1 when step 2 is asked for: every rank skips
        ckpt_io._write_fully = _slow_write(ckpt_io._write_fully, 1.0)  # type: ignore[assignment]
    else:  # rank 1's write of step 1 fails (and is over) before step 2 is asked for

        def full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        ckpt_io._write_fully = full  # type: ignore[assignment]
    ckpt = Checkpointer(directory, when_busy="skip")
    ckpt.save(1, model=_model())
    if rank == 1:
        time.sleep(0.5)
    skipped = ckpt.save(2, model=_model())  # no error yet: nobody settles a skipped save
    try:
        ckpt.wait()
    except CheckpointError as exc:
        Path(directory, f"error{rank}").write_text(str(exc))
    Path(directory, f"skipped{rank}").write_text(str(skipped.exists()))


@pytest.mark.multirank
def test_a_failure_seen_before_a_skipped_save_is_reported_on_every_rank(tmp_path):
    """Rank 1's write failed while rank 0's was still running: the save after it is skipped on
    both, and the failure is raised at the next settling (here ``wait()``) on both ranks."""
    lockstep.spawn(_failed_write_then_skip, 2, (str(tmp_path),), timeout=120)
    for rank in range(2):
        error = (tmp_path / f"error{rank}").read_text()
        assert "step_000000000001 failed on rank 1" in error and "No space left" in error, error
        assert (tmp_path / f"skipped{rank}").read_text() == "False"
    assert not (tmp_path / "step_000000000001").exists()


def test_another_checkpointer_on_the_directory_waits_for_the_write(tmp_path, monkeypatch):
    model = _model()
    monkeypatch.setattr(ckpt_io, "_write_fully", _slow_write(ckpt_io._write_fully))
    first = Checkpointer(tmp_path, blocking=False).save(1, model=model)
    # Another object sees the checkpoint once written, and its save does not take the
    # first one's staging directory for a crash's leftover.
    assert Checkpointer(tmp_path).latest() == first
    Checkpointer(tmp_path, blocking=False).save(2, model=model)
    second = Checkpointer(tmp_path)
    restored = second.restore(model=_model(1))
    assert restored is not None and restored.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000000001", "step_000000000002"]


def _save_and_return(rank: int, directory: str) -> int:
    lockstep.init_distributed()
    ckpt_io._write_fully = _slow_write(ckpt_io._write_fully, 1.0)  # type: ignore[assignment]
    torch.manual_seed(0)
    Checkpointer(directory).save(4, model=_model())  # asynchronous: still being written
    return rank


@pytest.mark.multirank
def test_a_spawned_function_that_returns_right_after_save_leaves_it_complete(tmp_path):
    """``lockstep.spawn`` lets a rank whose write is still running exit by itself instead of
    killing it once every rank has returned (which lost the checkpoint)."""
    assert lockstep.spawn(_save_and_return, 2, (str(tmp_path),), timeout=120) == [0, 1]
    torch.manual_seed(0)
    want, model = _model(), _model(1)
    assert Checkpointer(tmp_path).restore(model=model).step == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.state_dict().items())


def test_exit_right_after_save_leaves_a_complete_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import torch, lockstep
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512)
        lockstep.Checkpointer({str(tmp_path)!r}).save(3, model=model)  # asynchronous by default
        torch.save(model.state_dict(), {str(tmp_path / "ref.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=os.environ)
    model = nn.Linear(512, 512)
    assert Checkpointer(tmp_path).restore(model=model).step == 3
    ref = torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())


def test_sigterm_waits_for_the_write(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch, lockstep
        from lockstep.checkpoint import io as ckpt_io
        real = ckpt_io._write_fully
        def slow(fd, data):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the thread writes
            real(fd, data)
        ckpt_io._write_fully = slow
        lockstep.Checkpointer({str(tmp_path)!r}, blocking=False).save(4, model=torch.nn.Linear(64, 64))
        signal.pause()
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, timeout=120, env=os.environ)
    assert proc.returncode == -signal.SIGTERM
    assert Checkpointer(tmp_path).restore(model=nn.Linear(64, 64)).step == 4


# -- multi-rank -----------------------------------------------------------------------------


def _two_ranks(rank: int, directory: str) -> None:
    lockstep.init_distributed()
    model = _model()
    ckpt = Checkpointer(directory, blocking=False)
    ckpt.save(1, model=model)
    ckpt.save(2, model=model)  # waits for 1
    ckpt.wait()
    latest = str(ckpt.latest())
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    ckpt.save(3, model=model)
    error = ""
    try:
        ckpt.wait()
    except CheckpointError as exc:
        error = str(exc)
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    result = {"latest": latest, "error": error, "after": str(ckpt.latest())}
    Path(directory, f"result{rank}.json").write_text(json.dumps(result))


@pytest.mark.multirank
def test_world_of_two_async_saves_and_an_error_on_rank_1(tmp_path):
    lockstep.spawn(_two_ranks, 2, (str(tmp_path),), timeout=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert result["latest"].endswith("step_000000000002"), result
        assert "step_000000000003 failed on rank 1: cannot write" in result["error"], result
        assert "rng-rank00001.pt" in result["error"], result
        assert result["after"].endswith("step_000000000002"), result
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("result", ".lockstep-alive")))
    assert names == ["step_000000000001", "step_000000000002"]
    assert len(list((tmp_path / "step_000000000002").iterdir())) == 3
