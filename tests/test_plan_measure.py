"""The planner against real runs on gloo: link measurement, profiles, predicted vs measured.

Timings on a shared CPU are noisy, so the checks that compare a prediction with a run use a
throttled comm hook (sleeps, which CPU load barely changes) that makes communication dominate,
and generous tolerances; the side-by-side figures are benchmarks/bench_plan.py's job.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lockstep.plan import load_profile, measure_link, measure_link_sweep
from lockstep.plan.validate import (
    measure_ddp,
    predict_throttled,
    profile_world1,
)

pytestmark = pytest.mark.multirank


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))  # ~2 MB of grads


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


@pytest.mark.timeout(180)
def test_predicted_exposed_communication_matches_a_throttled_run(tmp_path):
    throttle = 10e6  # bytes/s: 2 MB of gradients held ~200 ms at world 2
    path = tmp_path / "profile.json"
    profile_world1(build, make_batch, loss_fn, steps=5, batch_size=16, path=str(path), timeout=100)
    assert load_profile(path).parameters == sum(p.numel() for p in build().parameters())
    sizes = (256 << 10, 4 << 20, 32 << 20)
    sweep = measure_link_sweep(2, sizes=sizes, repeats=3, timeout=100)
    link = sweep.link
    assert link.alpha >= 0 and link.beta > 0 and link.name == "measured"
    assert len(sweep.seconds) == 3 and len(sweep.seconds[0]) == len(sizes)
    lo, hi = sweep.spread()["beta"]
    assert 0 < lo <= hi
    # The run measures its own link, in its own ranks, right before its steps.
    got = measure_ddp(build, make_batch, loss_fn, 2, steps=5, throttle=throttle, timeout=100,
                      sweep_sizes=sizes)
    assert got["link"].world == 2 and got["link"].link.beta > 0
    assert got["exposed_s"] >= 0 and got["exposed_backward_s"] >= 0
    step, exposed = predict_throttled(str(path), got["link"].link, throttle, 2)
    # Generous bounds: the throttle's sleeps dominate, but the CPU is shared.
    assert 0.5 < exposed / got["exposed_s"] < 2.0, (exposed, got)
    assert 0.5 < step / got["step_s"] < 2.0, (step, got)


@pytest.mark.timeout(120)
def test_sweep_splits_an_allreduce_into_cpu_work_and_waiting():
    link = measure_link(2, sizes=(64 << 10, 4 << 20, 16 << 20), repeats=3, timeout=100)
    # gloo's CPU time (copies, sums) grows with the bytes; how much of the wall time it is
    # depends on the machine's load, so only its presence and sign are checked.
    assert link.cpu_share is not None and link.cpu_share[1] > 0, link
    assert all(x >= 0 for x in link.cpu_share)


def _adam_state_bytes(rank: int) -> dict:
    import lockstep

    lockstep.init_distributed()
    out = {}
    for zero in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        model = lockstep.DistributedDataParallel(net)
        opt = (lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
               if zero else torch.optim.Adam(model.parameters(), lr=1e-3))
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        # Adam's moments; its per-tensor step counters are not model-sized state.
        out[zero] = sum(v.numel() * v.element_size() for s in opt.state.values()
                        for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor))
    out["params"] = sum(p.numel() for p in net.parameters())
    return out


@pytest.mark.timeout(120)
def test_optimizer_state_memory_matches_what_zero_holds():
    from lockstep.multiproc import spawn
    from lockstep.plan import model_state_memory

    rows = spawn(_adam_state_bytes, 2, timeout=100)
    psi = rows[0]["params"]
    for zero in (False, True):
        want = model_state_memory(psi, 2, 1 if zero else 0, mixed_precision=False).optimizer
        for row in rows:  # equal tensors: ZeRO's partition splits them evenly
            assert row[zero] == pytest.approx(want, rel=0.02)


@pytest.mark.slow  # a second variant of the world-1 profile case
@pytest.mark.timeout(120)
def test_world1_profile_beside_companions_is_still_a_world_of_one():
    # One companion trains the same model at the same time (as a second rank would compute).
    doc = profile_world1(build, make_batch, loss_fn, steps=3, batch_size=16, timeout=100, beside=1)
    assert doc["world_size"] == 1 and doc["buckets"]
    assert all(b["allreduce"] == 0 and b["ready"] > 0 for b in doc["buckets"])  # nothing sent
    assert sum(b["bytes"] for b in doc["buckets"]) == doc["model"]["grad_bytes"]
    with pytest.raises(ValueError, match="beside"):
        profile_world1(build, make_batch, loss_fn, beside=-1)
