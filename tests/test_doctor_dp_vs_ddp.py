"""DataParallel's share of replication, gather and device 0's work, and what DDP would save.

Tiers: the report's arithmetic on given phases (no process); argument checks; one end-to-end
comparison on CPU (DataParallel over ['cpu', 'cpu'] here, DDP in 2 gloo workers), through the
API and through ``lockstep doctor --dp-vs-ddp``.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from lockstep.cli import build_parser
from lockstep.doctor import DPvsDDP, compare_dp_ddp
from lockstep.doctor.command import run_doctor
from lockstep.doctor.dp_report import dp_section

DP = {"scatter": 0.001, "replicate": 0.02, "parallel_apply": 0.03, "gather": 0.004, "loss": 0.006,
      "backward": 0.03, "optimizer": 0.005, "other": 0.004, "step": 0.1}
DDP = {"data": 0.0, "forward": 0.01, "backward": 0.015, "exposed_comm": 0.005, "optimizer": 0.005,
       "other": 0.005, "step": 0.04}


def model_fn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


# ---- the report, pure ---------------------------------------------------------------------
def test_dp_section_gives_each_share_of_the_step():
    text = dp_section(DP, 2)
    assert "DataParallel on 2 devices: 100.0 ms per step" in text
    assert "20.0%     20.0  replication" in text
    assert "replication 20.0%, gather 4.0%, device 0's extra work (gather + loss) 10.0%" in text
    assert "all DataParallel-only work 31.0% of the step" in text  # replicate+scatter+gather+loss


def test_dp_vs_ddp_saving_and_verdict():
    result = DPvsDDP(2, "cpu", 10, 2, DP, DDP, 1e-8)
    assert result.saving_s == pytest.approx(0.06) and result.speedup == pytest.approx(2.5)
    assert "DDP would save 60.0 ms per step (60% of DataParallel's step" in result.table()
    assert json.loads(json.dumps(result.to_json()))["saving_s"] == pytest.approx(0.06)
    slower = DPvsDDP(2, "cpu", 10, 2, DP, {**DDP, "step": 0.15}, 0.0)
    assert "DDP would cost 50.0 ms per step" in slower.table()


def test_compare_checks_its_arguments():
    with pytest.raises(ValueError, match="devices >= 2"):
        compare_dp_ddp(model_fn, batch_fn, devices=1)
    with pytest.raises(ValueError, match="threads=0"):
        compare_dp_ddp(model_fn, batch_fn, devices=2, threads=0)
    with pytest.raises(ValueError, match="batch of 8, which does not split evenly over 3"):
        compare_dp_ddp(model_fn, batch_fn, devices=3, device_type="cpu")


# ---- end to end on CPU ----------------------------------------------------------------------
@pytest.mark.slow  # the CLI case below runs the same comparison end to end by default
@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_compare_dp_ddp_on_two_cpu_devices():
    result = compare_dp_ddp(model_fn, batch_fn, devices=2, steps=3, warmup=1, device_type="cpu",
                            timeout=120)
    # Both trained the same model on the same batches: equal up to float rounding.
    assert result.max_param_diff < 1e-5
    for phase in ("replicate", "scatter", "parallel_apply", "gather", "loss", "backward"):
        assert result.dp_phases[phase] > 0, phase
    assert result.ddp_phases["backward"] > 0 and result.ddp_phases["step"] > 0
    assert result.saving_s == pytest.approx(result.dp_phases["step"] - result.ddp_phases["step"])
    table = result.table()
    assert "replication" in table and "device 0's extra work" in table
    assert "DDP on 2 processes" in table and "DDP would" in table


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_doctor_cli_dp_vs_ddp(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the doctor puts the file's folder first
    models = tmp_path / "tiny_models_for_doctor.py"
    models.write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def model_fn():
            torch.manual_seed(0)
            return nn.Linear(6, 2)

        def batch_fn(step):
            gen = torch.Generator().manual_seed(step)
            return torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
    '''))
    args = build_parser().parse_args(
        ["doctor", "--dp-vs-ddp", "--nproc-per-node", "2", "--steps", "3", "--warmup", "1",
         "--out-dir", str(tmp_path / "out"), str(models)])
    try:
        assert run_doctor(args) == 0
    finally:
        sys.modules.pop("tiny_models_for_doctor", None)
    shown = capsys.readouterr().out
    assert "DataParallel on 2 devices" in shown and "DDP would" in shown
    saved = json.loads((tmp_path / "out" / "dp_vs_ddp.json").read_text())
    assert saved["devices"] == 2 and saved["max_param_diff"] < 1e-5
    missing = tmp_path / "no_batch_fn.py"
    missing.write_text("def model_fn():\n    return None\n")
    args = build_parser().parse_args(["doctor", "--dp-vs-ddp", str(missing)])
    assert run_doctor(args) == 2
    assert "defines no batch_fn" in capsys.readouterr().err


_ARGPARSE_MODELS = '''
import argparse
import torch
from torch import nn

args = argparse.ArgumentParser().parse_args()  # at import: must see no doctor arguments

def model_fn():
    return nn.Linear(6, 2)

def batch_fn(step):
    return torch.randn(4, 6), torch.randn(4, 2)
'''


@pytest.mark.parametrize("case", ["syntax", "argparse", "script", "raises", "exits"])
def test_doctor_dp_vs_ddp_names_a_models_file_it_cannot_load(tmp_path, capsys, monkeypatch, case):
    """A syntax error, an import that fails or exits, or a training script (refused before it
    runs) each end with one error naming the file; a module parsing its arguments at import
    sees none of the doctor's."""
    from lockstep.cli import main
    from lockstep.doctor.dp_vs_ddp import load_models_file

    monkeypatch.setattr(sys, "path", list(sys.path))  # the doctor puts the file's folder first
    marker = tmp_path / "ran"
    text = {
        "syntax": "def model_fn(:\n    pass\n",
        "argparse": _ARGPARSE_MODELS,
        "script": f"open({str(marker)!r}, 'w').write('trained')\n",
        "raises": "raise RuntimeError('boom')\ndef model_fn(): pass\ndef batch_fn(s): pass\n",
        "exits": "import sys\nsys.exit(3)\ndef model_fn(): pass\ndef batch_fn(s): pass\n",
    }[case]
    name = f"doctor_models_{case}"
    models = tmp_path / f"{name}.py"
    models.write_text(text)
    try:
        if case == "argparse":
            monkeypatch.setattr(sys, "argv", ["lockstep", "doctor", "--dp-vs-ddp", str(models)])
            assert set(load_models_file(models)) == {"model_fn", "batch_fn"}
            assert sys.argv[1] == "doctor"  # given back
            return
        assert main(["doctor", "--dp-vs-ddp", "--steps", "3", "--warmup", "1",
                     "--out-dir", str(tmp_path / "out"), str(models)]) == 2
    finally:
        sys.modules.pop(name, None)
    err = capsys.readouterr().err
    assert f"lockstep doctor: error: lockstep doctor --dp-vs-ddp: {models}" in err, err
    assert "Traceback" not in err
    expected = {"syntax": "is not valid Python", "script": "defines no model_fn or batch_fn",
                "raises": "RuntimeError: boom", "exits": "SystemExit: 3"}[case]
    assert expected in err
    assert not marker.exists()  # the training script was not run
