"""Restoring from the shared-memory copies (``Checkpointer(memory=True)``): bitwise the disk's."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.checkpoint import Checkpointer


def _train(seed: int = 0, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _restore(ckpt: Checkpointer) -> tuple[object, dict, dict, tuple]:
    model, optimizer = _train(seed=1, steps=1)  # other weights, other optimizer state
    restored = ckpt.restore(model=model, optimizer=optimizer)
    rng = (torch.get_rng_state(), random.random())
    return restored, model.state_dict(), optimizer.state_dict(), rng


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def test_restore_from_memory_is_bitwise_the_disk_restore(tmp_path):
    model, optimizer = _train()
    memory = tmp_path / "shm"
    ckpt = Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory)
    for step in (1, 2, 3):
        ckpt.save(step, model=model, optimizer=optimizer, extra={"loss": 0.5})
    ckpt.wait()
    assert sorted(p.name for p in memory.iterdir()) == ["step_000000000002", "step_000000000003"]
    from_memory = _restore(Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory))
    from_disk = _restore(Checkpointer(tmp_path / "ck"))
    assert from_memory[0].source == "memory" and from_disk[0].source == "disk"
    assert from_memory[0].step == from_disk[0].step == 3
    assert from_memory[0].path == from_disk[0].path == tmp_path / "ck" / "step_000000000003"
    assert from_memory[0].extra == {"loss": 0.5}
    assert _same(from_memory[1:], from_disk[1:])
    assert _same(from_memory[1], model.state_dict())


def test_damaged_or_missing_memory_copy_falls_back_to_disk(tmp_path):
    model, optimizer = _train()
    memory = tmp_path / "shm"
    ckpt = Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory, blocking=True)
    ckpt.save(5, model=model, optimizer=optimizer)
    state = memory / "step_000000000005" / "state.pt"
    state.write_bytes(state.read_bytes()[:-8])  # cut short: the checksum catches it
    restored = _restore(Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory))
    assert restored[0].source == "disk" and restored[0].step == 5
    assert _same(restored[1], model.state_dict())
    shutil.rmtree(memory)  # the machine restarted: tmpfs is empty
    restored = _restore(Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory))
    assert restored[0].source == "disk" and _same(restored[1], model.state_dict())


def test_another_runs_copies_of_the_same_step_are_not_restored(tmp_path):
    # Run A keeps copies in memory; its directory is deleted by hand and run B (no memory)
    # saves the same step. A restore must give B's weights, not A's (it did before).
    memory = tmp_path / "shm"
    first, first_opt = _train(seed=0)
    Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory, blocking=True).save(
        4, model=first, optimizer=first_opt)
    shutil.rmtree(tmp_path / "ck")
    second, second_opt = _train(seed=7)
    Checkpointer(tmp_path / "ck", blocking=True).save(4, model=second, optimizer=second_opt)
    restored = _restore(Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory))
    assert restored[0].source == "disk" and restored[0].step == 4
    assert _same(restored[1], second.state_dict())


def test_a_copy_that_does_not_fit_leaves_no_partial_file(tmp_path, monkeypatch):
    from lockstep.checkpoint import replicas

    model, optimizer = _train()
    memory = tmp_path / "shm"
    ckpt = Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory, blocking=True)
    real = Path.write_bytes

    def full(self, data):  # a tmpfs that fills up half way through the copy
        real(self, bytes(data)[:16])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(replicas.Path, "write_bytes", full)
    ckpt.save(1, model=model, optimizer=optimizer)  # the copy fails, the disk save does not
    monkeypatch.undo()
    left = [p for p in memory.rglob("*") if p.is_file()] if memory.exists() else []
    assert left == []  # the partial copy was removed with its empty folder
    assert _restore(Checkpointer(tmp_path / "ck"))[0].step == 1


def test_only_the_newest_published_step_is_read_from_memory(tmp_path):
    model, optimizer = _train()
    memory = tmp_path / "shm"
    ckpt = Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory, blocking=True)
    ckpt.save(1, model=model, optimizer=optimizer)
    ckpt.save(2, model=model, optimizer=optimizer)
    shutil.rmtree(tmp_path / "ck" / "step_000000000002")  # as if its publish never happened
    restored = _restore(Checkpointer(tmp_path / "ck", memory=True, memory_dir=memory))
    assert restored[0].step == 1 and restored[0].source == "memory"
    ckpt.close()
    assert not memory.exists()


def _two_machines(rank: int, directory: str, out: str) -> None:
    """Each rank has its own tmpfs (as on two machines); rank 1's files must cross over."""
    lockstep.init_distributed()
    model, optimizer = _train(seed=0, steps=2 + rank)  # ranks differ: the checks see who wrote
    torch.manual_seed(100 + rank)
    memory = Path(directory) / f"shm{rank}"
    ckpt = Checkpointer(Path(directory) / "ck", memory=True, memory_dir=memory)
    ckpt.save(7, model=model, optimizer=optimizer)
    ckpt.wait()
    expected = (torch.rand(3).tolist(), model.state_dict())
    results = {}
    for mode in ("memory", "disk"):
        kwargs = {"memory": True, "memory_dir": memory} if mode == "memory" else {}
        restored = _restore(Checkpointer(Path(directory) / "ck", **kwargs))
        results[mode] = {"source": restored[0].source, "rng": torch.rand(3).tolist()}
        torch.save(restored[1:3], Path(out) / f"{mode}{rank}.pt")
    results["expected_rng"] = expected[0]
    torch.save(expected[1], Path(out) / f"expected{rank}.pt")
    # Rank 1's machine is lost: its tmpfs is empty; rank 0's holds rank 1's files (the ring).
    ckpt.save(8, model=model, optimizer=optimizer)
    ckpt.wait()  # and replicates step 8 to the next rank's machine
    after_save = torch.rand(3).tolist()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(memory)
    dist.barrier()
    restored = _restore(Checkpointer(Path(directory) / "ck", memory=True, memory_dir=memory))
    results["lost"] = {"source": restored[0].source, "step": restored[0].step,
                       "rng": torch.rand(3).tolist(), "expected_rng": after_save}
    dist.barrier()
    Path(out, f"result{rank}.json").write_text(json.dumps(results))


@pytest.mark.multirank
def test_world_of_two_restores_from_memory_across_machines_and_after_one_is_lost(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lockstep.spawn(_two_machines, 2, (str(tmp_path), str(out)), timeout=120)
    rank0_model = torch.load(out / "expected0.pt")
    for rank in range(2):
        result = json.loads((out / f"result{rank}.json").read_text())
        assert result["memory"]["source"] == "memory" and result["disk"]["source"] == "disk"
        assert result["memory"]["rng"] == result["disk"]["rng"] == result["expected_rng"]
        memory, disk = torch.load(out / f"memory{rank}.pt"), torch.load(out / f"disk{rank}.pt")
        assert _same(memory, disk)
        assert _same(memory[0], rank0_model)  # rank 0's state, also on rank 1
        lost = result["lost"]
        assert lost["source"] == "memory" and lost["step"] == 8, lost
        assert lost["rng"] == lost["expected_rng"]
    # rank 1's new machine received its files back from rank 0's
    assert sorted(p.name for p in (tmp_path / "shm1" / "step_000000000008").iterdir()) == [
        "rng-rank00000.pt", "rng-rank00001.pt", "state.pt"]
