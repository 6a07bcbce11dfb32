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
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.doctor.account import speedup_account

CLIENTS = Path(__file__).parent / "clients"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _observed_and_plain(rank: int, steps: int) -> dict:
    """Train an observed and an unobserved torch DDP on the same batches; return both."""
    from lockstep.doctor.torch_ddp import TorchDDPWatch

    lockstep.init_distributed()
    watch = TorchDDPWatch({"out_dir": None, "max_steps": None, "warmup": 0, "gather_every": 0})
    # 10 KB buckets: each 64x64 layer (16 KB) closes one, so there are several
    observed = nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.01)
    plain = nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.01)
    models = {"observed": observed, "plain": plain}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        for name, model in models.items():
            nn.functional.cross_entropy(model(x), y).backward()
            opts[name].step()
            opts[name].zero_grad()
            watch.stop_discovery()  # the observed model was found at its first forward
    assert [o.ddp for o in watch.observers] == [observed]
    rec = watch.observers[0].recorder
    out = {"params": {n: [p.detach().clone() for p in m.parameters()] for n, m in models.items()},
           "buckets": [[(b.index, b.launch, b.done, b.waited) for b in s.buckets]
                       for s in rec.steps],
           "layout": rec.layout()}
    watch.close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_observed_torch_ddp_reduces_like_torch_and_stamps_each_bucket():
    steps = 4
    for r in lockstep.spawn(_observed_and_plain, 2, (steps,), timeout=90):
        # the observer's comm hook launches the default all-reduce itself: the same bits
        for a, b in zip(r["params"]["observed"], r["params"]["plain"], strict=True):
            assert torch.equal(a, b)
        assert len(r["layout"]) >= 3
        indices = sorted(b["index"] for b in r["layout"])
        assert len(r["buckets"]) == steps
        for step, buckets in enumerate(r["buckets"]):  # one launch and completion per bucket
            # torch rebuilds its buckets after the first step (one 1 MB bucket before)
            assert sorted(i for i, _, _, _ in buckets) == (indices if step else [0])
            assert all(None not in (launch, done, waited) and launch <= done <= waited
                       for _, launch, done, waited in buckets)


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
