"""Checkpointer: exact resume, atomicity, damage detection, safe loading, clear errors.

Tiers: single-process round trips and file damage; one world of 2 on gloo for per-rank RNG,
a full disk on one rank and a world-size change; one world of 2 in which a rank is SIGKILLed
in the middle of writing.
"""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
import random
import resource
import signal
import tracemalloc
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.checkpoint import Checkpointer, CheckpointError, load_weights, tensorfile
from lockstep.checkpoint import io as ckpt_io
from lockstep.checkpoint.fit import check_optimizer_fits
from lockstep.small_gather import SLOT_BYTES, all_gather_small

# torch sets TORCHINDUCTOR_CACHE_DIR the first time an Adam is built; do it at import so the
# conftest's environment-leak check does not blame the first test that builds one.
torch.optim.Adam(nn.Linear(1, 1).parameters())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.3)  # consumes torch's RNG: resume must restore it
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Counter:
    """A sampler-like object: anything with state_dict/load_state_dict is saved alike."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _objects(seed: int = 0, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler(device, enabled=True),
        "sampler": Counter(),
    }


def _train(objs: dict, steps: int, sync: bool = False) -> None:
    """Steps that draw from Python, NumPy and torch RNGs, so a lost RNG state shows."""
    model, opt = objs["model"], objs["optimizer"]
    device = next(model.parameters()).device
    for _ in range(steps):
        # On CUDA both randn and dropout draw from the CUDA generator.
        x = torch.randn(4, 6, device=device) + random.random() + float(np.random.rand())
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        if sync:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        objs["scheduler"].step()
        objs["sampler"].consumed += 4


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_resume_is_bitwise_exact(tmp_path, device):
    _seed_all(1)
    objs = _objects(device=device)
    _train(objs, 3)
    ckpt = Checkpointer(tmp_path, keep=2)
    assert ckpt.restore(**objs) is None  # nothing yet, nothing changed
    ckpt.save(3, epoch=1, extra={"note": "hi", "best": torch.tensor(0.5)}, **objs)
    _train(objs, 3)
    expected = _params(objs["model"])

    _seed_all(99)  # a restarted process starts from other RNG states
    if device == "cuda":
        torch.cuda.manual_seed_all(99)
    fresh = _objects(seed=7, device=device)
    resumed = ckpt.restore(**fresh)
    assert (resumed.step, resumed.epoch, resumed.extra["note"]) == (3, 1, "hi")
    assert resumed.path == tmp_path / "step_000000000003"
    assert fresh["sampler"].consumed == 12
    assert fresh["scheduler"].last_epoch == 3
    _train(fresh, 3)
    for got, want in zip(_params(fresh["model"]), expected):
        assert torch.equal(got, want)


def test_keeps_newest_k_and_skips_damaged(tmp_path):
    objs = _objects()
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model=objs["model"], blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000000002", "step_000000000003"]
    newest = tmp_path / "step_000000000003" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint .*step_000000000003.*truncated"):
        resumed = ckpt.restore(model=objs["model"])
    assert resumed.step == 2
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        assert ckpt.latest() == tmp_path / "step_000000000002"


def test_encoded_file_is_one_buffer_and_files_of_earlier_versions_still_read(tmp_path):
    state = {"w": torch.arange(6.0), "step": 3}
    data = ckpt_io.encode(state)
    header, _, payload = bytes(data).partition(b"\n")
    magic, digest, length = header.split(b" ")
    # The header is written in front of the encoded bytes, in the same buffer: fixed width.
    assert magic == b"LOCKSTEP-CKPT-2" and int(length) == len(payload) and len(length) == 20
    assert digest == b"%08x" % zlib.crc32(payload)
    # Files as lockstep wrote them before: torch.save's bytes, the length padded or not.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    old = buffer.getvalue()
    old_digest = b"%08x" % zlib.crc32(old)
    padded = b"LOCKSTEP-CKPT-1 %s %020d\n" % (old_digest, len(old)) + old
    earlier = b"LOCKSTEP-CKPT-1 %s %d\n" % (old_digest, len(old)) + old
    for name, content in (("now.pt", data), ("padded.pt", padded), ("earlier.pt", earlier)):
        ckpt_io.write_atomic(tmp_path / name, content)
        ckpt_io.check_length(tmp_path / name)
        got = ckpt_io.load_file(tmp_path / name)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 3
        assert ckpt_io.decode(content, name)["step"] == 3


def _same_as_torch(got, want) -> None:
    """``got`` is what ``want`` gives back through torch.save/torch.load: types, values, dtypes,
    strides, offsets, requires_grad and which tensors share a storage."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.requires_grad) == (
            want.dtype, want.shape, want.stride(), want.storage_offset(), want.requires_grad)
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
        assert torch.equal(got.detach(), want.detach())
    elif isinstance(want, dict):
        assert list(got) == list(want) and getattr(got, "__dict__", {}).keys() == getattr(
            want, "__dict__", {}).keys()
        for key in want:
            _same_as_torch(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same_as_torch(a, b)
    else:
        assert got == want


def test_lean_encoding_gives_back_what_torch_load_does(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    base = torch.arange(24, dtype=torch.float64)
    state = {
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "optimizer": optimizer.state_dict(),
        "dtypes": [torch.ones(3, dtype=d) for d in (
            torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool, torch.complex64)],
        "views": (base, base[3:9], base.view(4, 6).t(), base.view(4, 6)[:, 2]),  # one storage
        "odd": {0: torch.tensor(2.5), 1: torch.empty(0, 3), "grad": torch.ones(2, requires_grad=True)},
        "plain": [None, True, 7, 1.5, "text", ()],
    }
    path = tmp_path / "state.pt"
    ckpt_io.save_atomic(path, state)
    assert path.read_bytes().startswith(b"LOCKSTEP-CKPT-2 ")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    want = torch.load(buffer, weights_only=True)
    for got in (ckpt_io.read_verified(path), ckpt_io.decode(ckpt_io.encode(state), "mem")):
        _same_as_torch(got, want)
        assert got["model"]._metadata == state["model"]._metadata
        storages = {v.untyped_storage().data_ptr() for v in got["views"]}
        assert len(storages) == 1  # the views still share their storage, as after torch.load
    # What the lean encoding does not cover is written by torch.save, and reads back the same.
    unusual = {"p": nn.Parameter(torch.ones(2)), "s": torch.ones(2, 2).to_sparse()}
    ckpt_io.save_atomic(path, unusual)
    assert path.read_bytes().startswith(b"LOCKSTEP-CKPT-1 ")
    got = ckpt_io.read_verified(path)
    assert type(got["p"]) is nn.Parameter and torch.equal(got["s"].to_dense(), torch.ones(2, 2))


@pytest.mark.skipif(not hasattr(torch.Tensor, "refine_names"), reason="named tensors are gone from this torch")
def test_named_tensors_are_not_saved_without_their_names(tmp_path):
    named = torch.zeros(2, 3).refine_names("N", "C")
    with pytest.raises(RuntimeError, match="(?i)named"):  # torch.save's own refusal, as before
        ckpt_io.save_atomic(tmp_path / "state.pt", {"x": named})


def _lean_file(path: Path, structure, tail: bytes = b"") -> None:
    """Write ``structure`` as a lean checkpoint pickle, checksum and all, as a crafted file would."""
    import pickle
    import struct

    body = pickle.dumps(("little", structure), protocol=4)
    payload = struct.pack("<Q", len(body)) + body + tail
    path.write_bytes(b"LOCKSTEP-CKPT-2 %08x %020d\n" % (zlib.crc32(payload), len(payload)) + payload)


class _Described:
    """Pickles as the persistent id of a tensor, with whatever description it is given."""

    def __init__(self, pid) -> None:
        self.pid = pid


def test_lean_files_that_would_run_code_or_reach_past_their_end_are_refused(tmp_path):
    import pickle

    marker = tmp_path / "pwned"
    path = tmp_path / "state.pt"
    _lean_file(path, {"meta": _Evil(marker)})
    with pytest.raises(CheckpointError, match=r"refusing to load .*state\.pt: it refers to .*system"):
        ckpt_io.read_verified(path)
    assert not marker.exists()

    class Crafted(pickle.Pickler):  # a tensor as a persistent id: how files were written before
        def persistent_id(self, obj):
            return obj.pid if isinstance(obj, _Described) else None

    class Marked(pickle.Pickler):  # a tensor as a call of the marker: how files are written now
        def reducer_override(self, obj):
            return (tensorfile._tensor, (obj.pid,)) if isinstance(obj, _Described) else NotImplemented

    def crafted(pid, tail: bytes, pickler=Crafted) -> None:
        buffer = io.BytesIO()
        pickler(buffer, protocol=4).dump(("little", {"w": _Described(pid)}))
        body = buffer.getvalue()
        import struct

        payload = struct.pack("<Q", len(body)) + body
        payload += bytes(-len(payload) % 64) + tail
        path.write_bytes(b"LOCKSTEP-CKPT-2 %08x %020d\n" % (zlib.crc32(payload), len(payload)) + payload)

    good = ("lockstep-tensor", 0, 16, "float32", 0, (4,), (1,), False)
    for pickler in (Crafted, Marked):
        crafted(good, bytes(16), pickler)
        assert torch.equal(ckpt_io.read_verified(path)["w"], torch.zeros(4))
    for (pid, tail, why), pickler in itertools.product((
        (good[:5] + ((5,),) + good[6:], bytes(16), "past the end of its storage"),
        (good[:2] + (2**40,) + good[3:], bytes(16), "more bytes than the file holds"),
        (good[:3] + ("Tensor",) + good[4:], bytes(16), "unknown tensor dtype"),
        (good[:6] + ((-1,),) + good[7:], bytes(16), "bad sizes"),
        (good, bytes(24), "8 bytes past its last tensor"),
    ), (Crafted, Marked)):
        crafted(pid, tail, pickler)
        with pytest.raises(CheckpointError, match=f"refusing to load .*state\\.pt: its? .*{why}"):
            ckpt_io.read_verified(path)
    crafted(good, bytes(16))
    data = bytearray(path.read_bytes())
    data[-60] ^= 0x01  # inside the structure: damage, named as such
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\.pt is corrupted"):
        ckpt_io.read_verified(path)


def test_streamed_file_equals_the_encoded_bytes_and_a_full_disk_keeps_the_old_one(
        tmp_path, monkeypatch):
    state = {"w": torch.randn(1000), "b": [torch.ones(3, dtype=torch.int64)], "n": None}
    path = tmp_path / "state.pt"
    ckpt_io.save_atomic(path, state)
    assert path.read_bytes() == bytes(ckpt_io.encode(state))
    # torch.save streams into the file: no copy of the 4 MiB payload is made in Python's memory
    # (encode()'s buffer is one).
    big = {"w": torch.zeros(2**20)}
    tracemalloc.start()
    try:
        ckpt_io.save_atomic(tmp_path / "big.pt", big)
        streamed = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        ckpt_io.encode(big)
        buffered = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert streamed < 2**20 < 4 * 2**20 <= buffered, (streamed, buffered)
    real_write = ckpt_io._write_fully

    def full_after_the_header(fd: int, data) -> None:
        if len(data) > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(ckpt_io, "_write_fully", full_after_the_header)
    with pytest.raises(CheckpointError, match=r"cannot write .*state\.pt: the disk or quota is full"):
        ckpt_io.save_atomic(path, {"w": torch.zeros(1000)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt", "state.pt"]  # no .tmp left
    assert torch.equal(ckpt_io.load_file(path)["w"], state["w"])  # the previous file, intact


def test_a_file_is_read_into_the_tensors_and_damage_is_named(tmp_path):
    path = tmp_path / "state.pt"
    ckpt_io.save_atomic(path, {"w": torch.arange(2**20, dtype=torch.float32)})
    tracemalloc.start()
    try:
        got = ckpt_io.read_verified(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(got["w"], torch.arange(2**20, dtype=torch.float32))
    assert peak < 2 * 2**20, peak  # the 4 MiB payload is checksummed in pieces, never held whole
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\.pt is corrupted: its CRC-32 checksum"):
        ckpt_io.read_verified(path)
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=r"state\.pt is truncated: \d+ of \d+ bytes"):
        ckpt_io.read_verified(path)
    path.write_bytes(b"PK" + bytes(100))
    with pytest.raises(CheckpointError, match=r"state\.pt is not a lockstep checkpoint file"):
        ckpt_io.read_verified(path)


def test_decode_names_truncation_corruption_and_foreign_files(tmp_path):
    data = ckpt_io.encode({"w": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"f\.pt is truncated: \d+ of \d+ bytes"):
        ckpt_io.decode(data[:-1], "f.pt")
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    with pytest.raises(CheckpointError, match=r"f\.pt is corrupted: its CRC-32 checksum does not match"):
        ckpt_io.decode(bytes(flipped), "f.pt")
    with pytest.raises(CheckpointError, match=r"f\.pt is not a lockstep checkpoint file"):
        ckpt_io.decode(b"hello\nworld", "f.pt")
    assert torch.equal(ckpt_io.decode(data, "f.pt")["w"], torch.ones(3))


class _Evil:
    """Unpickling this runs a shell command: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    plain = tmp_path / "evil.pt"
    torch.save({"fc1.weight": _Evil(marker)}, plain)
    with pytest.raises(CheckpointError, match=r"refusing to load .*evil\.pt.*could run code"):
        load_weights(Net(), plain)
    # The same payload inside a well-formed lockstep checkpoint, checksum and all.
    good = Checkpointer(tmp_path / "ck")
    path = good.save(1, model=Net(), blocking=True)
    (path / "state.pt").write_bytes(ckpt_io.encode({"meta": _Evil(marker)}))
    with pytest.warns(UserWarning, match="refusing to load"):
        assert good.restore(model=Net()) is None
    assert not marker.exists()


def test_loads_torch_ddp_files_and_wrapped_models(tmp_path):
    torch.manual_seed(0)
    source = Net()
    lockstep.init_distributed()
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(source)
        torch.save(wrapped.state_dict(), tmp_path / "ddp.pt")  # keys start with module.
        Checkpointer(tmp_path / "ck").save(5, model=wrapped, blocking=True)
    finally:
        lockstep.shutdown_distributed()
    from safetensors.torch import save_file

    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    for name in ("ddp.pt", "w.safetensors"):
        target = Net()
        load_weights(target, tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(_params(target), _params(source)))
    state = ckpt_io.read_verified(tmp_path / "ck" / "step_000000000005" / "state.pt")
    assert all(not key.startswith("module.") for key in state["objects"]["model"])
    target = Net()
    Checkpointer(tmp_path / "ck").restore(model=target)
    assert all(torch.equal(a, b) for a, b in zip(_params(target), _params(source)))


def test_other_model_lists_missing_and_unexpected_keys(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=Net())
    other = nn.Sequential(nn.Linear(6, 8))
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(model=other)
    message = str(info.value)
    assert "holds weights of another model" in message
    assert "missing keys: 0.bias, 0.weight" in message
    assert "unexpected keys: fc1.bias, fc1.weight, fc2.bias, fc2.weight" in message
    wider = Net()
    wider.fc2 = nn.Linear(8, 3)
    expected = r"shape mismatch \(file vs model\): fc2.bias \(2,\) vs \(3,\)"
    with pytest.raises(CheckpointError, match=expected):
        ckpt.restore(model=wider)
    with pytest.raises(CheckpointError, match=r"has no 'optimizer'; it holds \['model'\]"):
        ckpt.restore(model=Net(), optimizer=torch.optim.SGD(Net().parameters(), lr=1))


def test_save_rejects_what_cannot_load_safely(tmp_path):
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"extra\['cfg'\]\[1\] is a builtins.set.*Convert it"):
        ckpt.save(1, extra={"cfg": [1, {2}]})
    with pytest.raises(CheckpointError, match=r"cannot checkpoint data=list: it has no state_dict"):
        ckpt.save(1, data=[1, 2])
    assert not any(tmp_path.iterdir())  # nothing half-written left behind
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="timeout must be positive seconds, got 0"):
        Checkpointer(tmp_path, timeout=0)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save(-1)


def test_unwritable_directory_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    expected = r"saving checkpoint .*file/ckpt/step_0+1 failed on rank 0: cannot write .*file/ckpt"
    with pytest.raises(CheckpointError, match=expected):
        Checkpointer(blocker / "ckpt").save(1, model=Net())


def test_full_disk_message():
    exc = OSError(28, "No space left on device")
    message = ckpt_io.describe_os_error(exc, Path("/ck/state.pt"), 3 * 2**20)
    assert "disk or quota is full (3.0 MiB needed)" in message
    assert "previous checkpoint is untouched" in message
    small = ckpt_io.describe_os_error(exc, Path("/ck/state.pt"), 40_000)
    assert "(39.1 KiB needed)" in small  # "(0.0 MiB needed)" until 2026-11-29


def _stepped(optimizer_class: type, model: nn.Module, **kwargs: float) -> torch.optim.Optimizer:
    optimizer = optimizer_class(model.parameters(), **kwargs)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    return optimizer


def test_an_optimizer_that_does_not_fit_is_refused_at_restore(tmp_path):
    """Another optimizer class, or state for parameters of other shapes, loaded and failed at
    the next step() (a KeyError, a size error naming no file) until 2026-11-29."""
    model = Net()
    ckpt = Checkpointer(tmp_path, blocking=True)
    ckpt.save(1, optimizer=_stepped(torch.optim.Adam, model, lr=1e-3))
    with pytest.raises(CheckpointError, match=r"state.pt: 'optimizer' was saved by another kind "
                       r"of optimizer than this SGD: its group 0 has \[.*'betas'.*and lacks \[.*'momentum'"):
        ckpt.restore(optimizer=torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9))
    other = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 2))  # as many parameters, other shapes
    with pytest.raises(CheckpointError, match=r"'optimizer' holds optimizer state for parameters "
                       r"of other shapes \(file vs optimizer: parameter 0 exp_avg \(8, 6\) vs \(8, 5\)"):
        ckpt.restore(optimizer=torch.optim.Adam(other.parameters(), lr=1e-3))
    fresh = torch.optim.Adam(Net().parameters(), lr=1e-3)
    assert ckpt.restore(optimizer=fresh).step == 1  # the same kind still loads
    # Settings only one side has (a newer torch adds some) are not another optimizer.
    state = fresh.state_dict()
    del state["param_groups"][0]["foreach"]
    check_optimizer_fits("optimizer", fresh, state, "older.pt")


def test_an_async_save_keeps_sparse_tensors_and_parameters_as_a_blocking_one_does(tmp_path):
    # Until 2026-11-29 the asynchronous snapshot failed on sparse tensors (copy_ between dense
    # and sparse) and brought an nn.Parameter back as a plain tensor.
    extra = {"param": nn.Parameter(torch.arange(3.0)), "coo": torch.eye(3).to_sparse(),
             "mixed": [torch.ones(2), torch.eye(2).to_sparse()]}
    for blocking in (False, True):
        ckpt = Checkpointer(tmp_path / str(blocking), blocking=blocking)
        ckpt.save(1, model=Net(), extra=extra)
        ckpt.wait()
        back = ckpt.restore(model=Net()).extra
        assert type(back["param"]) is nn.Parameter and torch.equal(back["param"], extra["param"])
        assert back["coo"].layout == torch.sparse_coo
        assert torch.equal(back["coo"].to_dense(), torch.eye(3))
        assert torch.equal(back["mixed"][0], torch.ones(2))
        assert torch.equal(back["mixed"][1].to_dense(), torch.eye(2))


def test_a_model_on_the_meta_device_is_refused_at_restore(tmp_path):
    ckpt = Checkpointer(tmp_path, blocking=True)
    ckpt.save(1, model=Net())
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(CheckpointError, match=r"into a model on the meta device \(fc1.weight, "
                       r"fc1.bias, fc2.weight, fc2.bias\).*to_empty"):
        ckpt.restore(model=meta)  # "restored" without a value until 2026-11-29
    meta.to_empty(device="cpu")
    assert ckpt.restore(model=meta).step == 1


def test_a_relative_directory_is_the_one_named_when_save_was_called(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere" / "ckpt").mkdir(parents=True)
    ckpt = Checkpointer("ckpt")  # resolved at each write until 2026-11-29: after a chdir (or
    os.chdir(tmp_path / "elsewhere")  # during an async save) it wrote elsewhere/ckpt
    ckpt.save(1, model=Net())
    ckpt.wait()
    assert (tmp_path / "ckpt").is_dir() and not any((tmp_path / "elsewhere" / "ckpt").iterdir())
    assert Checkpointer(tmp_path / "ckpt").restore(model=Net()).step == 1


# -- multi-rank -----------------------------------------------------------------------------


def _world_of_two(rank: int, directory: str) -> None:
    """Resume exactly, survive a full disk on rank 1, then die while writing (rank 0)."""
    lockstep.init_distributed()
    # The checkpoint's agreements: small values in one collective, a larger one (rank 1's)
    # taking every rank to all_gather_object.
    gathered = [all_gather_small(("dir", rank, None)),
                all_gather_small("x" * (SLOT_BYTES + 1) if rank == 1 else rank)]
    _seed_all(100 + rank)  # every rank draws its own data: per-rank RNG states matter
    objs = _objects()
    ckpt = Checkpointer(directory, keep=3)
    _train(objs, 2, sync=True)
    ckpt.save(2, **objs)
    _train(objs, 2, sync=True)
    expected = _params(objs["model"])
    _seed_all(0)
    fresh = _objects(seed=5)
    resumed = ckpt.restore(**fresh)
    _train(fresh, 2, sync=True)
    exact = all(torch.equal(a, b) for a, b in zip(_params(fresh["model"]), expected))
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    try:
        ckpt.save(4, model=fresh["model"], blocking=True)
        error = ""
    except CheckpointError as exc:
        error = str(exc)
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    # The classic mistake: saving under `if rank == 0:`; rank 0 must fail naming rank 1.
    only_rank0 = ""
    if rank == 0:
        try:
            Checkpointer(Path(directory, "rank0-only"), timeout=2).save(1, model=fresh["model"])
        except CheckpointError as exc:
            only_rank0 = str(exc)
    result = {"step": resumed.step, "exact": exact, "error": error, "latest": str(ckpt.latest()),
              "only_rank0": only_rank0,
              "gathered": gathered == [[("dir", 0, None), ("dir", 1, None)], [0, "x" * (SLOT_BYTES + 1)]]}
    Path(directory, f"result{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if rank == 0:
        real_write = ckpt_io._write_fully

        def write_half_then_die(fd: int, data: bytes) -> None:
            real_write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        ckpt_io._write_fully = write_half_then_die
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.add_(1.0)
    # blocking: the write (and the SIGKILL in it) happens before save() returns, so rank 0 can
    # never report success first (asynchronous, its writer thread raced the function's return)
    ckpt.save(6, model=fresh["model"], blocking=True)


@pytest.mark.multirank
def test_world_of_two_resume_full_disk_and_kill_mid_write(tmp_path, capfd):
    ckpt_dir = tmp_path / "ck"
    with pytest.raises(lockstep.WorkerError, match="rank 0 died with signal 9"):
        lockstep.spawn(_world_of_two, 2, (str(ckpt_dir),), timeout=120)
    # Rank 0 waited 2 s for rank 1 in a meeting: quietly (the store's own timed wait would have
    # logged two warning lines per look).
    assert "waitForInput" not in capfd.readouterr().err
    for rank in range(2):
        result = json.loads((ckpt_dir / f"result{rank}.json").read_text())
        assert result["step"] == 2 and result["exact"] and result["gathered"], f"rank {rank}: {result}"
        # A full disk on rank 1 only: every rank gets the error; step 2 survives.
        assert "failed on rank 1: cannot write" in result["error"]
        assert "disk or quota is full" in result["error"]
        assert result["latest"].endswith("step_000000000002")
    only_rank0 = json.loads((ckpt_dir / "result0.json").read_text())["only_rank0"]
    assert only_rank0.startswith(
        "rank 0 waited 2s in Checkpointer.save(step=1) for rank(s) [1], which never called it. "
        "Call save() and restore() on every rank, not only on rank 0. Where they are: rank 1 on "
    ), only_rank0
    names = sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(("result", ".lockstep-alive")))
    assert names == [".staging-step_000000000006", "step_000000000002"]  # 6 was cut short
    assert len(list((ckpt_dir / "step_000000000002").iterdir())) == 3  # state + 2 RNG files
    # A world of one resumes from the world of two (model, optimizer, sampler are replicated).
    objs = _objects(seed=3)
    resumed = Checkpointer(ckpt_dir).restore(model=objs["model"], sampler=objs["sampler"])
    assert (resumed.step, resumed.world_size, objs["sampler"].consumed) == (2, 2, 8)
    saved = ckpt_io.read_verified(resumed.path / "state.pt")["objects"]["model"]
    assert all(torch.equal(saved[k], v) for k, v in objs["model"].state_dict().items())


def _zero_round_trip(rank: int, directory: str) -> float:
    lockstep.init_distributed()

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return model, lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)

    def train(model, opt, steps, start):
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(step * 2 + rank)
            x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():  # average by hand: this test is about the optimizer
                torch.distributed.all_reduce(p.grad)
                p.grad /= 2
            opt.step()

    model, opt = build()
    train(model, opt, 2, 0)
    ckpt = lockstep.Checkpointer(directory)
    ckpt.save(2, model=model, optimizer=opt)
    train(model, opt, 2, 2)
    resumed_model, resumed_opt = build()
    assert ckpt.restore(model=resumed_model, optimizer=resumed_opt).step == 2
    train(resumed_model, resumed_opt, 2, 2)
    return max((a - b).abs().max().item()
               for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_zero_optimizer_checkpoints_without_manual_consolidation(tmp_path):
    assert lockstep.spawn(_zero_round_trip, 2, (str(tmp_path),), timeout=90) == [0.0, 0.0]


def test_nested_wrapper_prefixes_are_stripped(tmp_path):
    model = torch.nn.Linear(2, 2)
    nested = {f"_orig_mod.module.{k}": v for k, v in model.state_dict().items()}  # compile(DDP(m))
    torch.save(nested, tmp_path / "nested.pt")
    target = torch.nn.Linear(2, 2)
    lockstep.load_weights(target, tmp_path / "nested.pt")
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), model.state_dict().values()))


class _Holder(torch.nn.Module):
    """An EMA-style wrapper whose only child is named ``module``: its own keys start with it."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


def test_a_model_whose_child_is_named_module_restores_its_own_keys(tmp_path):
    model = _Holder()
    ckpt = Checkpointer(tmp_path / "c")
    ckpt.save(1, model=model, blocking=True)
    target = _Holder()
    assert Checkpointer(tmp_path / "c").restore(model=target) is not None
    torch.save(model.state_dict(), tmp_path / "own.pt")
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp.pt")
    for name in ("own.pt", "ddp.pt"):  # its own keys as they are; torch DDP's lose one prefix
        other = _Holder()
        lockstep.load_weights(other, tmp_path / name)
        assert torch.equal(other.module.weight, model.module.weight)
    assert torch.equal(target.module.weight, model.module.weight)


def test_damaged_safetensors_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(lockstep.CheckpointError, match="cannot read .*w.safetensors"):
        lockstep.load_weights(torch.nn.Linear(2, 2), bad)


def test_crash_while_replacing_a_step_keeps_the_old_copy(tmp_path):
    model = torch.nn.Linear(2, 2)
    ckpt = lockstep.Checkpointer(tmp_path, keep=1)
    first = ckpt.save(1, model=model, blocking=True)
    os.replace(first, tmp_path / f".replaced-{first.name}")  # as if killed mid-publish
    ckpt.save(2, model=model, blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        (tmp_path / ckpt.latest()).name]
    assert ckpt.latest().name != first.name or first.exists()


@pytest.mark.parametrize("keep", [1, 3])
def test_fresh_start_after_damaged_checkpoints_is_kept(tmp_path, keep):
    """All checkpoints damaged, a fresh start saves a lower step: it must survive keep-K."""
    model = torch.nn.Linear(2, 2)
    writer = Checkpointer(tmp_path, keep=3)
    for path in [writer.save(step, model=model, blocking=True) for step in (10, 20, 30)]:
        state = path / "state.pt"
        state.write_bytes(state.read_bytes()[:-10])  # truncated
    ckpt = Checkpointer(tmp_path, keep=keep)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        assert ckpt.restore(model=model) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = ckpt.save(5, model=model, blocking=True)
    messages = " ".join(str(w.message) for w in caught)
    names = sorted(p.name for p in tmp_path.iterdir())
    if keep == 1:  # the damaged ones are beyond the one kept: deleted like any surplus
        assert names == ["step_000000000005"]
    else:  # they would have counted as kept: set aside, each named in a warning
        for step in (10, 20, 30):
            assert f"step_{step:012d} is damaged" in messages
            assert f"moved it aside to {tmp_path / f'.damaged-step_{step:012d}'}" in messages
        assert names == [
            ".damaged-step_000000000010", ".damaged-step_000000000020",
            ".damaged-step_000000000030", "step_000000000005",
        ]
    resumed = Checkpointer(tmp_path, keep=keep).restore(model=model)
    assert resumed is not None and resumed.step == 5 and resumed.path == new


def test_keep_counts_only_intact_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model=model, blocking=True)
    (tmp_path / "step_000000000003" / "rng-rank00000.pt").unlink()  # damaged
    with pytest.warns(UserWarning, match=r"step_000000000003 is damaged .* moved it aside"):
        ckpt.save(4, model=model, blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "step_000000000002", "step_000000000004"]


def test_a_save_below_a_kept_higher_step_is_warned(tmp_path):
    """A counter reset saves step 5 beside a kept step 30: restore() takes step 30 (the highest),
    not the newest written. The save says so (it was silent), naming the higher step; with
    keep=1 the higher step is gone and nothing is said."""
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ckpt.save(step, model=model, blocking=True)
    with pytest.warns(UserWarning, match=r"step_000000000005 was just written, but 1 kept "
                                         r"checkpoint\(s\) have a higher step \(step_000000000030\)"):
        ckpt.save(5, model=model, blocking=True)
    assert ckpt.latest().name == "step_000000000030"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(tmp_path, keep=1).save(4, model=model, blocking=True)
    assert Checkpointer(tmp_path).latest().name == "step_000000000004"


def test_a_directory_missing_on_this_machine_is_said_to_be_probably_not_shared(tmp_path):
    """Another machine's rank made the step directory; here it is missing: the checkpoint
    directory is not shared. The error says so instead of a bare ENOENT."""
    from lockstep.checkpoint.io import CheckpointError, check_length, save_atomic

    unseen = tmp_path / "step_000000000004" / "state.pt"
    with pytest.raises(CheckpointError, match="missing on this machine.*not shared by every"):
        check_length(unseen)
    with pytest.raises(CheckpointError, match="missing on this machine.*not shared by every"):
        save_atomic(unseen, {"a": torch.ones(2)})
    present = tmp_path / "absent.pt"  # its directory exists: a plain missing file, no hint
    with pytest.raises(CheckpointError) as err:
        check_length(present)
    assert "shared" not in str(err.value)
