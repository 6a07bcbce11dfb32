"""Misuse that users report ends in an error saying what is wrong and what to do.

The issue-level list, where no module's own tests cover it: a model spread over devices when
wrapped, unusable ``device_ids``, a CPU model under NCCL (GPU), and the ``lockstep run`` command
line refusing arguments that cannot work before starting anything. Checkpoint and collective
misuse is tested in ``test_checkpoint.py`` and ``test_watchdog.py``.
"""

from __future__ import annotations

import pytest
from torch import nn

import lockstep
from lockstep.cli import main as cli_main


@pytest.fixture
def world1():
    lockstep.init_distributed()
    yield
    lockstep.shutdown_distributed()


def test_model_on_two_devices_is_refused(world1):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].to("meta")  # half the model "left behind" on another device
    with pytest.raises(ValueError, match=(
        r"parameter '1.weight' is on meta but '0.weight' is on cpu; .* Move the whole model "
        r"with model.to\(device\) before wrapping"
    )):
        lockstep.DistributedDataParallel(model)


def test_several_device_ids_are_refused(world1):
    with pytest.raises(ValueError, match=r"device_ids=\[0, 1\]: lockstep's DDP drives one device"):
        lockstep.DistributedDataParallel(nn.Linear(4, 2), device_ids=[0, 1])


@pytest.mark.gpu
def test_cpu_model_under_nccl_is_refused():
    lockstep.init_distributed(backend="nccl", device="cuda:0")
    try:
        with pytest.raises(ValueError, match=r"the model is on cpu but the process group uses NCCL"):
            lockstep.DistributedDataParallel(nn.Linear(4, 2))
    finally:
        lockstep.shutdown_distributed()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0", "{script}"], "--nproc-per-node 0: a machine needs at least 1 worker"),
        (["--rdzv-endpoint", "head-node:http", "{script}"], "has a port 'http' that is not a number"),
        (["{missing}"], "training script '{missing}' does not exist"),
    ],
)
def test_launcher_refuses_arguments_that_cannot_work(tmp_path, capsys, argv, message):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must never start')\n")
    names = {"script": str(script), "missing": str(tmp_path / "nope.py")}
    status = cli_main(["run", *(arg.format(**names) for arg in argv)])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep run: error: ")
    assert message.format(**names) in err
