"""lockstep doctor: each injected cause is named, the speedup account adds up.

Tiers: the arithmetic (phases, bus bandwidth, the account, environment settings) without
processes; then one world of 1, 2 and 3 ranks each, running every scenario in the same
processes (a healthy MLP, a rank sleeping in its data loader, a rank slow in forward, a comm
hook throttled to a set bandwidth, a first layer whose large gradient arrives last). The tests
check what the doctor *names*, never how long anything took.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.doctor.account import speedup_account
from lockstep.doctor.env import settings_from_env
from lockstep.doctor.profile_file import build_profile, busbw
from lockstep.doctor.records import PHASES, phases_of

STEPS, WARMUP, BATCH = 14, 4, 64
SLEEP = 0.03  # the injected delay: seconds per step on the slow rank
THROTTLE = 10e6  # bytes/s of bus bandwidth the throttling hook allows


# ---- pure logic ---------------------------------------------------------------------------
def test_phases_add_up_to_the_step():
    step = {"begin": 0.0, "end": 1.0, "forwards": [[0.1, 0.15, 0.3]],
            "backwards": [[0.35, 0.6, 0.7]], "optimizer": [[0.8, 0.95]], "buckets": []}
    p = phases_of(step)
    assert p["data"] == pytest.approx(0.1) and p["forward"] == pytest.approx(0.15)
    assert p["exposed_comm"] == pytest.approx(0.05 + 0.1) and p["optimizer"] == pytest.approx(0.15)
    assert sum(p[k] for k in PHASES) == pytest.approx(p["step"]) == 1.0


def test_busbw_is_the_nccl_tests_convention():
    assert busbw(1e6, 0.01, 2) == pytest.approx(1e8)
    assert busbw(1e6, 0.01, 4) == pytest.approx(1e8 * 1.5)
    assert busbw(1e6, 0.01, 1) == 0.0


def test_env_settings_and_errors():
    assert settings_from_env({}) is None
    got = settings_from_env({"LOCKSTEP_PROFILE": "/x", "LOCKSTEP_PROFILE_STEPS": "9"})
    assert got == {"out_dir": "/x", "max_steps": 9, "warmup": 5, "gather_every": 0}
    with pytest.raises(ValueError, match="LOCKSTEP_PROFILE_STEPS='ten' is not a whole number"):
        settings_from_env({"LOCKSTEP_PROFILE": "/x", "LOCKSTEP_PROFILE_STEPS": "ten"})


# ---- multi-rank scenarios -----------------------------------------------------------------
class Sleepy(nn.Module):
    """Sleeps in forward on one rank: a slow device."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


def _mlp(sleep: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), Sleepy(sleep), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def _three_layers() -> nn.Module:
    # 256 KB per layer and bucket_cap_mb=0.2: one bucket per layer.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(),
                         nn.Linear(256, 256, bias=False), nn.ReLU(),
                         nn.Linear(256, 256, bias=False))


def _late_first_layer() -> nn.Module:
    # 8 MB of first-layer weight: its gradient is the last one backward produces.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 10))


def _throttled_hook(state, bucket):
    """An asynchronous all-reduce that completes no sooner than THROTTLE bus bandwidth allows."""
    start = time.perf_counter()
    buf, n = bucket.buffer(), dist.get_world_size()
    work = dist.all_reduce(buf, async_op=True)
    target = buf.numel() * buf.element_size() * 2 * (n - 1) / n / THROTTLE
    fut: torch.futures.Future = torch.futures.Future()

    def finish() -> None:
        work.wait()
        buf.div_(n)
        time.sleep(max(0.0, target - (time.perf_counter() - start)))
        fut.set_result(buf)

    threading.Thread(target=finish, daemon=True).start()
    return fut


def _train(model: nn.Module, rank: int, in_dim: int, data_sleep: float = 0.0,
           hook=None, **ddp_kwargs) -> dict:
    ddp = lockstep.DistributedDataParallel(model, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    prof = ddp.enable_profiling(warmup=WARMUP)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        if data_sleep:
            time.sleep(data_sleep)  # the data loader of this rank is slow
        x = torch.randn(BATCH, in_dim, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    payload = prof.payload()
    ddp.enable_profiling(False)
    return payload


def _scenarios(rank: int) -> dict:
    lockstep.init_distributed()
    world = dist.get_world_size()
    slow = world - 1  # the last rank is the slow one
    out = {"healthy": _train(_mlp(), rank, 128), "late": _train(_late_first_layer(), rank, 2048)}
    if world == 1:
        return out
    out["data"] = _train(_mlp(), rank, 128, data_sleep=SLEEP if rank == slow else 0.0)
    out["forward"] = _train(_mlp(SLEEP if rank == slow else 0.0), rank, 128)
    out["throttle"] = _train(_three_layers(), rank, 256, hook=_throttled_hook,
                             bucket_cap_mb=0.2)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    result = {}
    for world in (1, 2, 3):
        per_rank = lockstep.spawn(_scenarios, world, timeout=240)
        result[world] = {name: build_profile([r[name] for r in per_rank])
                         for name in per_rank[0]}
    return result


WORLDS = [pytest.param(2, marks=pytest.mark.multirank), pytest.param(3, marks=pytest.mark.multirank)]


@pytest.mark.parametrize("world", WORLDS)
def test_profile_has_the_documented_fields(runs, world):
    prof = runs[world]["healthy"]
    for key in ("format", "version", "world_size", "model", "phases", "buckets", "per_rank"):
        assert key in prof
    assert prof["format"] == "lockstep-profile" and prof["world_size"] == world
    assert prof["steps"] == STEPS - WARMUP and prof["batch_size_per_rank"] == BATCH
    assert [r["rank"] for r in prof["per_rank"]] == list(range(world))
    assert prof["model"]["grad_bytes"] == sum(b["bytes"] for b in prof["buckets"])
    assert all(b["allreduce"] > 0 and b["busbw"] > 0 for b in prof["buckets"])
    for rank in prof["per_rank"]:
        p = rank["phases"]
        assert sum(p[k] for k in PHASES) == pytest.approx(p["step"])


@pytest.mark.parametrize("world", WORLDS)
def test_healthy_run_names_no_straggler_and_the_account_adds_up(runs, world):
    prof = runs[world]["healthy"]
    assert prof["attribution"]["straggler"]["rank"] is None
    acc = speedup_account(runs[1]["healthy"], prof)
    total = acc.measured + sum(x.speedup for x in acc.losses) + acc.unexplained.speedup
    assert total == pytest.approx(world)
    assert abs(acc.unexplained.seconds) <= 0.10 * acc.step_n
    assert "unexplained" in acc.table() and f"ideal {world}.00x" in acc.table()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cause, phase", [("data", "data"), ("forward", "forward")])
def test_the_slow_rank_is_named_with_its_phase(runs, world, cause, phase):
    straggler = runs[world][cause]["attribution"]["straggler"]
    assert (straggler["rank"], straggler["phase"]) == (world - 1, phase)
    acc = speedup_account(runs[1]["healthy"], runs[world][cause])
    assert f"straggler rank {world - 1} in {phase}" in acc.table()
    assert acc.losses[0].key == "straggler" or acc.losses[1].key == "straggler"
    assert any(f"rank {world - 1}" in a.text for a in acc.actions)


@pytest.mark.parametrize("world", WORLDS)
def test_throttled_bandwidth_is_measured(runs, world):
    prof = runs[world]["throttle"]
    assert len(prof["buckets"]) == 3
    for bucket in prof["buckets"]:
        assert bucket["busbw"] == pytest.approx(THROTTLE, rel=0.2), bucket
    assert prof["attribution"]["busbw"] == pytest.approx(THROTTLE, rel=0.2)


@pytest.mark.parametrize("world", WORLDS)
def test_late_large_gradient_is_named_as_exposed(runs, world):
    prof = runs[world]["late"]
    att = prof["attribution"]
    bucket = att["exposed_bucket"]
    assert bucket is not None and bucket["last_param"] == "0.weight"
    assert "0.weight" in bucket["params"] and bucket["bytes"] >= 2048 * 1024 * 4
    acc = speedup_account(runs[1]["late"], prof)
    assert f"bucket {bucket['index']}" in acc.table() and "0.weight" in acc.table()
