"""The deferred copy of an asynchronous save (issue #24): parameters and optimizer state are
copied after ``save()`` returns, completed before the next step, and a change made meanwhile
outside the optimizer fails the save instead of being written."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint import Checkpointer, CheckpointError
from lockstep.checkpoint import deferred as ckpt_deferred
from lockstep.checkpoint import io as ckpt_io
from lockstep.checkpoint.deferred import CopyPieces, DeferredCopy, pieces, split, stepped_storages
from lockstep.checkpoint.snapshot import Snapshot

torch.optim.Adam(nn.Linear(1, 1).parameters())  # see test_checkpoint.py: TORCHINDUCTOR_CACHE_DIR


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        optimizer.step()


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of decoded checkpoint files."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _files(path: Path) -> dict[str, Any]:
    return {p.name: ckpt_io.read_verified(p) for p in sorted(path.iterdir())}


@pytest.fixture
def slow_copy(monkeypatch):
    """Deferred copies that start 0.2 s late, so the loop reaches its next step first."""
    real = DeferredCopy.run

    def late(self: DeferredCopy) -> None:
        time.sleep(0.2)
        real(self)

    monkeypatch.setattr(DeferredCopy, "run", late)


def test_the_copy_of_parameters_and_optimizer_state_is_deferred():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer)
    files = {"state.pt": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}
    snapshot, later = Snapshot().take(files, stepped_storages([optimizer]))
    deferred = {name for name, _, _ in later._jobs}
    assert "state.pt/model/0.weight" in deferred and "state.pt/optimizer/state/0/exp_avg" in deferred
    assert "state.pt/model/1.running_mean" not in deferred  # a forward changes it: copied now
    assert torch.equal(snapshot["state.pt"]["model"]["1.running_mean"], model[1].running_mean)
    later.run()
    assert later.check() is None
    assert all(torch.equal(snapshot["state.pt"]["model"][k], v)
               for k, v in model.state_dict().items())


def test_deferred_save_equals_a_blocking_save_when_the_loop_steps_at_once(tmp_path, slow_copy):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer, steps=2)
    Checkpointer(tmp_path / "blocking").save(2, model=model, optimizer=optimizer, blocking=True)
    ckpt = Checkpointer(tmp_path / "deferred")
    ckpt.save(2, model=model, optimizer=optimizer)
    _train(model, optimizer, steps=3)  # forward changes BatchNorm's statistics, step the rest
    ckpt.wait()
    blocking = _files(tmp_path / "blocking" / "step_000000000002")
    deferred = _files(tmp_path / "deferred" / "step_000000000002")
    assert _equal(blocking, deferred)
    assert ckpt.snapshot_bytes > 0


def test_a_parameter_changed_after_save_fails_the_save_naming_it(tmp_path, slow_copy):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(1, model=model, optimizer=optimizer)
    ckpt.wait()
    ckpt.save(2, model=model, optimizer=optimizer)
    with torch.no_grad():
        model[3].bias.clamp_(-0.01, 0.01)  # outside the optimizer, before its next step
    _train(model, optimizer)  # the step completes and checks the copy; it does not raise
    with pytest.raises(CheckpointError, match=r"step_000000000002 failed on rank 0: "
                       r"state\.pt/objects/model/3\.bias was changed in place after "
                       r"save\(step=2\).*ckpt\.wait\(\)"):
        ckpt.wait()
    assert ckpt.latest() == tmp_path / "step_000000000001"
    assert not any(p.name.startswith(".staging") for p in tmp_path.iterdir())
    ckpt.save(3, model=model, optimizer=optimizer)  # the next save works
    ckpt.wait()
    assert ckpt.latest() == tmp_path / "step_000000000003"


def test_a_change_is_caught_by_the_next_checkpoint_call_without_a_step(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=model, optimizer=optimizer)
    model.load_state_dict(_model(seed=1).state_dict())  # copy_ into every parameter
    with pytest.raises(CheckpointError, match=r"state\.pt/objects/model/0\.weight was changed"):
        ckpt.save(2, model=model, optimizer=optimizer)
    assert ckpt.latest() is None


def test_changing_weights_after_wait_is_fine(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=model, optimizer=optimizer)
    ckpt.wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.save(2, model=model)  # the previous save is not failed by a change after wait()
    restored = _model(seed=3)
    ckpt.wait()
    assert Checkpointer(tmp_path).restore(model=restored).step == 2
    assert not torch.equal(restored.state_dict()["0.weight"], expected["0.weight"])


def test_without_an_optimizer_or_with_defer_copy_false_everything_is_copied_at_once(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for directory, ckpt, objects in [
        (tmp_path / "a", Checkpointer(tmp_path / "a"), {"model": model}),
        (tmp_path / "b", Checkpointer(tmp_path / "b", defer_copy=False),
         {"model": model, "optimizer": optimizer}),
    ]:
        ckpt.save(1, **objects)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)  # not a change the copy can see: it was taken before
        ckpt.wait()
        restored = _model(seed=1)
        assert Checkpointer(directory).restore(model=restored).step == 1
        assert _equal(restored.state_dict(), expected)
        model.load_state_dict(expected)
    with pytest.raises(TypeError, match="defer_copy"):
        Checkpointer(tmp_path, defer_copy="yes")  # type: ignore[arg-type]


def test_step_hooks_do_not_accumulate_over_saves(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(tmp_path, keep=1)
    for step in range(1, 21):
        _train(model, optimizer)
        ckpt.save(step, model=model, optimizer=optimizer)
        # at most this save's hook (the last one fired and was removed by this save)
        assert len(optimizer._optimizer_step_pre_hooks) <= 1
    _train(model, optimizer)
    ckpt.wait()
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    ckpt.save(21, model=model, optimizer=optimizer, blocking=True)  # a blocking save adds none
    assert len(optimizer._optimizer_step_pre_hooks) == 0


def test_exit_right_after_save_leaves_a_complete_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import torch, lockstep
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 512)).sum().backward()
        optimizer.step()
        torch.save({{"model": model.state_dict(), "optimizer": optimizer.state_dict()}},
                   {str(tmp_path / "ref.pt")!r})
        lockstep.Checkpointer({str(tmp_path / "ckpt")!r}).save(3, model=model, optimizer=optimizer)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=os.environ)
    model = nn.Linear(512, 512)
    optimizer = torch.optim.Adam(model.parameters())
    assert Checkpointer(tmp_path / "ckpt").restore(model=model, optimizer=optimizer).step == 3
    ref = torch.load(tmp_path / "ref.pt")
    assert _equal(model.state_dict(), ref["model"])
    assert _equal(optimizer.state_dict()["state"], ref["optimizer"]["state"])


def test_the_writer_checks_itself_once_the_saving_thread_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_deferred, "_POLL_S", 0.001)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path)
    saver = threading.Thread(target=lambda: ckpt.save(1, model=model, optimizer=optimizer))
    saver.start()
    saver.join()
    for _ in range(500):  # no step, no checkpoint call: published once the saver has ended
        if (tmp_path / "step_000000000001").exists():
            break
        time.sleep(0.01)
    assert (tmp_path / "step_000000000001").exists()


def test_a_step_right_after_save_copies_what_the_writing_thread_did_not_reach(tmp_path,
                                                                            monkeypatch):
    """The writing thread is held before its first piece until the step has returned: a step
    that merely waited for it would wait the hold's whole timeout, and fail the assertion."""
    release = threading.Event()
    released: list[bool] = []
    real = DeferredCopy.run

    def held(self: DeferredCopy) -> None:
        released.append(release.wait(timeout=10))  # False: the step did not return without it
        real(self)

    monkeypatch.setattr(DeferredCopy, "run", held)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer, steps=2)
    Checkpointer(tmp_path / "blocking").save(2, model=model, optimizer=optimizer, blocking=True)
    ckpt = Checkpointer(tmp_path / "deferred")
    ckpt.save(2, model=model, optimizer=optimizer)
    optimizer.step()  # at once: copies every piece itself, then changes the parameters
    release.set()
    ckpt.wait()
    assert released == [True], "the step waited for the writing thread instead of copying"
    assert _equal(_files(tmp_path / "blocking" / "step_000000000002"),
                  _files(tmp_path / "deferred" / "step_000000000002"))


def test_check_alone_completes_the_copy_in_pieces(monkeypatch):
    monkeypatch.setattr(ckpt_deferred, "_CHUNK_BYTES", 64)
    large, strided = torch.randn(40, 7), torch.randn(9, 8).t()  # 1120 bytes; not contiguous
    jobs = [(name, source, torch.empty_like(source, memory_format=torch.contiguous_format))
            for name, source in [("large", large), ("strided", strided), ("scalar", torch.tensor(3.0))]]
    assert len(split(large, jobs[0][2])) == 18 and len(split(strided, jobs[1][2])) == 1
    later = DeferredCopy(jobs, [])
    assert later.check() is None  # no writing thread at all: the checking thread copied it
    later.run()  # nothing left to copy
    assert all(torch.equal(source, buffer) for _, source, buffer in jobs)


def test_small_tensors_are_copied_together_and_large_ones_in_chunks():
    pairs = [(torch.randn(4), torch.empty(4)) for _ in range(10)]  # 16 bytes each
    pairs.append((torch.randn(40), torch.empty(40)))  # 160 bytes: its own chunks of 64
    pairs.append((torch.randn(2), torch.empty(2)))
    parts = pieces(pairs, 64)
    assert [len(sources) for sources, _ in parts] == [4, 4, 2, 1, 1, 1, 1]
    assert [sources[0].numel() for sources, _ in parts[3:]] == [16, 16, 8, 2]
    copier = CopyPieces(parts)
    copier.work()
    assert copier.failure is None and all(torch.equal(s, b) for s, b in pairs)


def test_the_waiter_copies_the_rest_then_waits_for_the_piece_in_flight(monkeypatch):
    monkeypatch.setattr(ckpt_deferred, "_CHUNK_BYTES", 64)
    source = torch.randn(64)  # four pieces of 16 floats
    buffer = torch.empty_like(source)
    later = DeferredCopy([("w", source, buffer)], [])
    in_flight, release = threading.Event(), threading.Event()
    copied: list[tuple[str, int]] = []
    real = CopyPieces._copy

    def copy(self: CopyPieces, index: int) -> None:
        if threading.current_thread().name == "writer":
            in_flight.set()
            assert release.wait(timeout=10)
        real(self, index)
        copied.append((threading.current_thread().name, index))

    monkeypatch.setattr(CopyPieces, "_copy", copy)
    writer = threading.Thread(target=later.run, name="writer")
    writer.start()
    assert in_flight.wait(timeout=10)  # the writer holds piece 0
    checker = threading.Thread(target=later.check, name="checker")
    checker.start()
    for _ in range(1000):
        if len(copied) == 3:
            break
        time.sleep(0.01)
    assert sorted(copied) == [("checker", 1), ("checker", 2), ("checker", 3)]
    assert checker.is_alive()  # waits for piece 0, in flight on the writer
    release.set()
    writer.join(timeout=10)
    checker.join(timeout=10)
    assert not writer.is_alive() and not checker.is_alive()
    assert ("writer", 0) in copied and later.error is None and torch.equal(source, buffer)


def test_a_failed_copy_on_the_waiter_is_raised_by_the_writing_thread():
    later = DeferredCopy([("w", torch.ones(3), torch.empty(4))], [])
    assert later.check() is None  # the step that helped does not fail
    with pytest.raises(RuntimeError, match="size"):
        later.run()  # the writing thread fails the save with it, as before


def test_a_piece_left_unfinished_is_copied_by_the_next_waiter(monkeypatch):
    sources = [torch.randn(5) for _ in range(3)]
    buffers = [torch.empty(5) for _ in range(3)]
    pieces = CopyPieces([([s], [b]) for s, b in zip(sources, buffers)])
    assert pieces._claim() == 0  # a frame a signal handler interrupted after claiming piece 0
    real = ckpt_deferred.copy_tensors
    calls = []

    def interrupted(into: list[torch.Tensor], out_of: list[torch.Tensor], *args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the copy of piece 1
        real(into, out_of, *args)

    monkeypatch.setattr(ckpt_deferred, "copy_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pieces.work()
    pieces.work()  # copies pieces 2, 0 (its own) and 1 (orphaned)
    assert all(torch.equal(s, b) for s, b in zip(sources, buffers))


@pytest.mark.gpu
def test_deferred_cuda_copy_equals_a_blocking_save(tmp_path):
    model = _model().cuda()
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 8, device="cuda")).pow(2).mean().backward()
        optimizer.step()
    Checkpointer(tmp_path / "blocking").save(2, model=model, optimizer=optimizer, blocking=True)
    ckpt = Checkpointer(tmp_path / "deferred")
    ckpt.save(2, model=model, optimizer=optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8, device="cuda")).pow(2).mean().backward()
        optimizer.step()
    ckpt.wait()
    assert _equal(_files(tmp_path / "blocking" / "step_000000000002"),
                  _files(tmp_path / "deferred" / "step_000000000002"))


# -- multi-rank ------------------------------------------------------------------------------


def _two_ranks(rank: int, directory: str) -> None:
    lockstep.init_distributed()
    model = lockstep.DistributedDataParallel(_model())
    optimizer = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(directory, keep=5)
    errors = []
    for step in (1, 2, 3):
        _train(model, optimizer)
        ckpt.save(step, model=model, optimizer=optimizer)
        if step == 2 and rank == 0:  # an EMA-like write outside the optimizer, on rank 0
            with torch.no_grad():
                next(model.parameters()).mul_(2.0)
        if step == 3 and rank == 1:  # rank 1 writes no parameters (state.pt is rank 0's)
            with torch.no_grad():
                next(model.parameters()).mul_(2.0)
        _train(model, optimizer)  # steps right after save(): the copy is completed first
        try:
            ckpt.wait()
            errors.append("")
        except CheckpointError as exc:
            errors.append(str(exc))
    result = {"errors": errors, "latest": str(ckpt.latest())}
    Path(directory, f"result{rank}.json").write_text(json.dumps(result))


@pytest.mark.multirank
def test_world_of_two_a_change_on_rank_0_fails_the_save_on_both(tmp_path):
    lockstep.spawn(_two_ranks, 2, (str(tmp_path),), timeout=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        first, second, third = result["errors"]
        assert first == "" and third == "", result
        assert "step_000000000002 failed on rank 0: state.pt/objects/model/0.weight was " \
               "changed in place after save(step=2)" in second, result
        assert result["latest"].endswith("step_000000000003"), result
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("result", ".lockstep-alive")))
    assert names == ["step_000000000001", "step_000000000003"]


def test_a_save_that_fails_after_its_saving_thread_ended_is_logged(tmp_path, monkeypatch, caplog):
    """The script changed a parameter in place after save() and ended: nobody will call the
    next save() or wait() that raises the error, so the writing thread logs it (it was
    silent; a SIGTERM's wait already said it)."""
    monkeypatch.setattr(ckpt_deferred, "_POLL_S", 0.001)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path)

    def save_then_change() -> None:
        ckpt.save(1, model=model, optimizer=optimizer)
        with torch.no_grad():
            next(model.parameters()).mul_(0.5)

    saver = threading.Thread(target=save_then_change)
    with caplog.at_level(logging.WARNING, logger="lockstep.checkpoint.background"):
        saver.start()
        saver.join()
        pending = ckpt._pending
        assert pending is not None
        pending._thread.join(30)
    assert "step_000000000001 was not saved (the program ended before its write finished)" in caplog.text
    assert "changed in place" in caplog.text
    assert not (tmp_path / "step_000000000001").exists()
