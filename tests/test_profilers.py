"""lockstep.profilers: the seam through which DDP and DataParallel get the doctor's recorders.

In this process, at a world of one. The wrappers never import the doctor (tests/test_layers.py);
here: ``import lockstep`` registers the doctor, the wrappers build what is registered, the
environment is read through it, and a registration can be replaced and put back. Recording
itself is tested in tests/test_doctor*.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep import profilers
from lockstep.ddp.wrapper import DistributedDataParallel
from lockstep.doctor.dp_recorder import DataParallelRecorder
from lockstep.doctor.profile_env import settings_from_env
from lockstep.doctor.recorder import Recorder
from lockstep.dp.data_parallel import DataParallel


def test_import_lockstep_registers_the_doctor():
    found = profilers.current()
    assert found.ddp is Recorder and found.dp is DataParallelRecorder
    assert found.settings_from_env is settings_from_env
    assert lockstep.ddp.StepTiming is lockstep.doctor.StepTiming is profilers.StepTiming


def test_the_wrappers_record_with_the_doctor(world_of_one):
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    assert ddp.profiler is None
    recorder = ddp.enable_profiling(warmup=0)
    assert isinstance(recorder, Recorder) and ddp.profiler is recorder
    ddp(torch.randn(3, 4)).sum().backward()
    assert len(ddp.step_timings) == 1 and ddp.step_timings[0].forward_s >= 0
    assert ddp.enable_profiling(False) is None and ddp.step_timings == []
    dp = DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    assert isinstance(dp.enable_profiling(), DataParallelRecorder)
    assert dp.enable_profiling(False) is None and dp.profiler is None


def test_lockstep_profile_in_the_environment_makes_ddp_record(world_of_one, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_PROFILE", str(tmp_path))
    monkeypatch.setenv("LOCKSTEP_PROFILE_WARMUP", "2")
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    recorder = ddp.profiler
    assert isinstance(recorder, Recorder) and recorder.out_dir == tmp_path and recorder.warmup == 2
    ddp(torch.randn(3, 4)).sum().backward()
    ddp.enable_profiling(False)  # saves
    assert (tmp_path / "rank0.json").exists()


def test_a_registration_replaces_the_doctor_until_put_back(world_of_one):
    doctor = profilers.current()
    built: list[tuple[Any, ...]] = []

    def ddp_recorder(*args: Any) -> Recorder:
        built.append(args)
        return Recorder(*args)

    previous = profilers.register(lambda: profilers.Profilers(
        ddp=ddp_recorder, dp=doctor.dp, settings_from_env=lambda: {"warmup": 7}))
    try:
        model = DistributedDataParallel(nn.Linear(4, 2))  # the environment, as registered
        assert isinstance(model.profiler, Recorder) and model.profiler.warmup == 7
        assert len(built) == 1 and built[0][0] == torch.device("cpu")
        model.enable_profiling(False)
    finally:
        assert profilers.register(previous) is not None
    assert profilers.current() == doctor


def test_registration_mistakes_are_named(monkeypatch):
    with pytest.raises(TypeError, match="callable returning Profilers, got Profilers"):
        profilers.register(profilers.current())  # the Profilers, not a loader of them
    monkeypatch.setattr(profilers, "_loader", None)
    with pytest.raises(RuntimeError, match="no profiler is registered"):
        profilers.current()
