"""The snapshot an asynchronous save writes from: one arena per file, reused, laid out again
when the state's tensors change (issue #24)."""

from __future__ import annotations

from collections import OrderedDict

import torch

import lockstep
from lockstep.checkpoint import tensorfile
from lockstep.checkpoint.snapshot import Snapshot


def _state() -> dict:
    base = torch.arange(24.0)
    return {
        "model.pt": OrderedDict(w=torch.randn(3, 4), t=base.view(4, 6).t(), b=torch.ones(5, dtype=torch.bool),
                                z=torch.empty(0, dtype=torch.float64),  # after 5 bytes: no arena
                                c=torch.randn(2, dtype=torch.complex64), e=torch.empty(0, 3),
                                h=torch.ones(3, dtype=torch.float16)),
        "optimizer.pt": {"state": {0: {"step": torch.tensor(3.0), "m": torch.randn(7)}},
                         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
    }


def _take(snapshot: Snapshot, files: dict) -> dict:
    out, later = snapshot.take(files)
    later.run()
    return out


def _same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want)
        for key in want:
            _same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    else:
        assert got == want


def _storages(content) -> int:
    plan = tensorfile.plan(content)
    assert plan is not None
    return sum(1 for piece in plan.pieces() if isinstance(piece, memoryview))  # tensor bytes (not header, pads)


def test_each_file_is_one_arena_reused_by_the_next_save():
    files = _state()
    snapshot = Snapshot()
    first = _take(snapshot, files)
    _same(first, files)
    for name in files:  # one storage per file: one piece of tensor bytes to write
        storages = {t.untyped_storage().data_ptr() for t in _tensors(first[name]) if t.numel()}
        assert len(storages) == 1 and _storages(first[name]) == 1
    assert snapshot.nbytes >= sum(t.numel() * t.element_size() for c in files.values() for t in _tensors(c))
    for tensor in _tensors(files):  # the loop trains on
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.add_(1)
    second = _take(snapshot, files)
    _same(second, files)
    assert [t.data_ptr() for t in _tensors(second) if t.numel()] == [
        t.data_ptr() for t in _tensors(first) if t.numel()]  # reused
    decoded = tensorfile.read(_reader(second["model.pt"]), _length(second["model.pt"]))[0]
    _same(decoded, files["model.pt"])


def test_a_changed_state_is_laid_out_again_and_copied_whole():
    files = _state()
    snapshot = Snapshot()
    _take(snapshot, files)
    held = snapshot.nbytes
    files["model.pt"]["w"] = torch.randn(5, 5)  # another shape
    files["optimizer.pt"]["state"][1] = {"step": torch.tensor(1.0), "m": torch.randn(2)}  # a new tensor
    _same(_take(snapshot, files), files)
    assert snapshot.nbytes > held
    del files["model.pt"]["h"]  # a tensor gone: its bytes are not held (nor written) any more
    before = snapshot.nbytes
    out = _take(snapshot, files)
    _same(out, files)
    assert snapshot.nbytes < before and "h" not in out["model.pt"]
    del files["optimizer.pt"]  # a file gone
    _same(_take(snapshot, files), files)
    assert snapshot.nbytes < before


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _encoded(content) -> bytes:
    plan = tensorfile.plan(content)
    assert plan is not None
    return b"".join(bytes(piece) for piece in plan.pieces())


def _reader(content):
    data = memoryview(_encoded(content))
    position = 0

    def readinto(view: memoryview) -> int:
        nonlocal position
        n = min(len(view), len(data) - position)
        view[:n] = data[position:position + n]
        position += n
        return n

    return readinto


def _length(content) -> int:
    return len(_encoded(content))


def test_a_large_state_is_cut_into_arenas_of_a_bounded_size(monkeypatch):
    from lockstep.checkpoint import snapshot as snapshot_module

    monkeypatch.setattr(snapshot_module, "_ARENA_BYTES", 256)  # pinned memory comes in powers of two
    files = {"state.pt": {"small": [torch.randn(10), torch.randn(40)], "large": torch.randn(100),
                          "tail": [torch.randn(3), torch.empty(0)]}}
    snapshot = Snapshot()
    out = _take(snapshot, files)
    _same(out, files)
    arenas = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(out) if t.numel()}
    assert sorted(arenas.values()) == [12, 224, 400]  # 40 + 160 bytes (aligned at 64) / 400 alone / 12
    assert _storages(out["state.pt"]) == 3 and snapshot.nbytes == 636


def test_keys_that_would_join_to_one_path_stay_apart(tmp_path):
    # "loss/train" next to {"loss": {"train": ...}}, and 0 next to "0": each value comes back.
    extra = {"loss/train": torch.tensor([1.0]), "loss": {"train": torch.tensor([2.0, 3.0])},
             "a": {0: torch.tensor([4.0]), "0": torch.tensor([5.0])}}
    ckpt = lockstep.Checkpointer(tmp_path)  # asynchronous: through the snapshot
    ckpt.save(1, extra=extra)
    ckpt.wait()
    _same(lockstep.Checkpointer(tmp_path).restore().extra, extra)


def test_a_restored_tensor_holds_its_own_memory_not_the_files_block(tmp_path):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    ckpt = lockstep.Checkpointer(tmp_path)
    ckpt.save(1, model=model, optimizer=optimizer, extra={"best": torch.tensor(0.5)})
    ckpt.wait()
    restored = lockstep.checkpoint.load_file(next(tmp_path.glob("step_*")) / "state.pt")
    for tensor in _tensors(restored):
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert ckpt.snapshot_bytes > 4 * 64 * 64 * 3  # the snapshot itself is one block per file
