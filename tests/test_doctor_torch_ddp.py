"""lockstep doctor on scripts that use torch's own DistributedDataParallel (lockstep/doctor/torch_ddp.py).

The plain torch-DDP script runs in the default suite. The Hugging Face Trainer and Lightning
scripts need the ``clients`` extra and run behind the ``clients`` marker::

    pip install torch==2.13.0 -e ".[test,clients]"
    HF_HUB_OFFLINE=1 python -m pytest -q -m clients tests/test_doctor_torch_ddp.py
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.doctor.account import speedup_account

CLIENTS = Path(__file__).parent / "clients"


def _doctor(script: str, out: Path, slow_rank: int | None, steps: int = 20) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(out)}
    env.pop("SLOW_RANK", None)
    if slow_rank is not None:
        env["SLOW_RANK"] = str(slow_rank)
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", str(steps),
         "--out-dir", str(out), str(CLIENTS / script)],
        check=False, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alone = json.loads((out / "world1" / "profile.json").read_text())
    many = json.loads((out / "world2" / "profile.json").read_text())
    return {"alone": alone, "many": many, "report": proc.stdout}


def _check(run: dict, slow_rank: int, phase: str) -> None:
    alone, many = run["alone"], run["many"]
    assert many["model"]["observed"] == "torch.nn.parallel.DistributedDataParallel"
    assert many["buckets"] and all(b["params"] for b in many["buckets"])
    assert alone["world_size"] == 1 and many["world_size"] == 2
    acc = speedup_account(alone, many)
    total = acc.measured + sum(x.speedup for x in acc.losses) + acc.unexplained.speedup
    assert total == pytest.approx(2)
    straggler = many["attribution"]["straggler"]
    assert (straggler["rank"], straggler["phase"]) == (slow_rank, phase), run["report"]
    assert f"straggler: rank {slow_rank}" in run["report"]


@pytest.mark.timeout(300)
def test_doctor_explains_an_unchanged_torch_ddp_script(tmp_path):
    _check(_doctor("torch_ddp_train.py", tmp_path, slow_rank=1), 1, "data")


@pytest.mark.clients
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, module", [("hf_trainer_train.py", "transformers"),
                                            ("lightning_train.py", "lightning")])
def test_doctor_explains_a_real_client(request, tmp_path, script, module):
    if "clients" not in (request.config.getoption("-m") or ""):
        pytest.skip("the slower tier: run with -m clients (see this file's docstring)")
    if importlib.util.find_spec(module) is None:  # not imported here: lightning sets env vars
        pytest.skip(f"{module} is not installed (the clients extra)")
    # the callback sleeps before the step: before the forward, i.e. in "data"
    _check(_doctor(script, tmp_path / "slow", slow_rank=1), 1, "data")
    healthy = _doctor(script, tmp_path / "healthy", slow_rank=None)
    straggler = healthy["many"]["attribution"]["straggler"]
    # as in tests/test_doctor.py: on a shared machine a real run can have a slower rank; when
    # one is named, the data must back it (not the injected 30 ms)
    assert straggler["rank"] is None or straggler["phase_excess_s"] < 0.02, healthy["report"]
