"""Devices from what was asked (lockstep.distributed.resolve_device) and CUDA timing marks.

The GPU paths are checked on a CPU build by standing in for torch.cuda: which GPU ``cuda``
means for each local rank, the errors when there is none, and that profiling marks are CUDA
events recorded on the rank's own stream, not a synchronisation per mark.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.distributed import resolve_device
from lockstep.doctor.stamps import Stamps


@pytest.fixture
def gpus(monkeypatch):
    """A CUDA build with four visible GPUs, as far as device resolution can tell."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_cuda_without_index_is_the_local_rank_gpu(gpus):
    assert resolve_device("cuda", 2) == torch.device("cuda", 2)
    assert resolve_device(torch.device("cuda"), 3) == torch.device("cuda", 3)
    assert resolve_device(None, 1) == torch.device("cuda", 1)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)  # an explicit index is kept
    assert resolve_device(0, 3) == torch.device("cuda", 0)
    assert resolve_device("cpu", 3) == torch.device("cpu")


def test_a_gpu_that_does_not_exist_is_named(gpus):
    with pytest.raises(RuntimeError, match="local rank 5 has no GPU: this machine has 4"):
        resolve_device("cuda", 5)
    with pytest.raises(RuntimeError, match=r"'cuda:7' does not exist: this machine has 4"):
        resolve_device("cuda:7", 0)


def test_cuda_on_a_build_without_cuda_says_so():
    if torch.backends.cuda.is_built():
        pytest.skip("this torch build has CUDA")
    with pytest.raises(RuntimeError, match="CUDA requested .* this torch build has no CUDA"):
        resolve_device("cuda", 0)
    assert resolve_device(None, 3) == torch.device("cpu")  # nothing asked: the CPU


def test_cuda_with_no_visible_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        resolve_device("cuda", 0)


def test_a_bad_name_is_a_value_error():
    with pytest.raises(ValueError, match="'gpu0' is not a device name"):
        resolve_device("gpu0", 0)


def test_init_distributed_fails_before_torch_on_a_cpu_build(monkeypatch):
    """The demo's ``--device cuda``: lockstep's error, not torch's missing-index one."""
    if torch.backends.cuda.is_built() or dist.is_initialized():
        pytest.skip("needs a CPU build and no process group yet")
    monkeypatch.delenv("LOCKSTEP_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="this torch build has no CUDA"):
        lockstep.init_distributed(device="cuda")
    assert not dist.is_initialized()


class _FakeEvent:
    recorded: ClassVar[list] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream
        _FakeEvent.recorded.append(stream)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _FakeEvent) -> float:
        return 0.0


def test_cuda_marks_are_events_on_the_ranks_stream_without_synchronising(gpus, monkeypatch):
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NullContext())
    _FakeEvent.recorded = []
    stamps = Stamps(torch.device("cuda", 1))
    marks = [stamps.now() for _ in range(10)]
    assert stamps.cuda and len(syncs) == 1  # once, to set the clock's zero; never per mark
    assert all(isinstance(m, _FakeEvent) for m in marks)
    assert _FakeEvent.recorded[1:] == [("stream of", torch.device("cuda", 1))] * 10


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_one_error_type_for_a_device_that_is_not_there(gpus):
    """init_distributed's resolution and DataParallel's device_ids raise the same type."""
    from lockstep.distributed import DeviceUnavailableError
    from lockstep.dp.devices import resolve_device_ids

    with pytest.raises(DeviceUnavailableError, match="'cuda:7' does not exist"):
        resolve_device("cuda:7", 0)
    with pytest.raises(DeviceUnavailableError, match="device_ids names cuda:9 but 4"):
        resolve_device_ids([9])
    assert issubclass(DeviceUnavailableError, RuntimeError)  # what torch raises for a missing GPU
    assert issubclass(DeviceUnavailableError, ValueError)  # what DataParallel raised before


@pytest.mark.parametrize("device_ids, output_device", [([0, 1], None), ([0], 0), (None, 0), (["cuda:0", "cuda:1"], 1)])
def test_dataparallel_naming_gpus_without_cuda_runs_on_the_cpu_like_torch(monkeypatch, device_ids, output_device):
    """torch's DataParallel ignores device_ids/output_device when CUDA is not available, so a
    script written for GPUs runs on a laptop; lockstep's does the same, and says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 2), torch.randn(5, 4)
    with pytest.warns(UserWarning, match="CUDA is not available: the module runs on the CPU"):
        ours = lockstep.DataParallel(model, device_ids=device_ids, output_device=output_device)
    theirs = torch.nn.DataParallel(model, device_ids=device_ids, output_device=output_device)
    assert torch.equal(ours(x), theirs(x))
    assert ours.device_ids == [torch.device("cpu")]
    with pytest.raises(ValueError, match="mixes device types"):  # a list naming the CPU is checked
        lockstep.DataParallel(model, device_ids=["cpu", 0])
