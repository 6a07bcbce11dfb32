"""DDP's buffer broadcast before every forward: recorded by the doctor, priced by the planner."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lockstep.cli import main
from lockstep.plan import (
    Bucket,
    Link,
    PlanOptions,
    ProfileError,
    Topology,
    Workload,
    collective,
    describe,
    load_profile,
    parse_strategy,
    plan,
    predict,
)
from lockstep.plan.costs import chain_broadcast, tree_broadcast

ALPHA, BETA = 1e-3, 1e9
LINK = Link("l", ALPHA, BETA)
BN = (1792.0, 24.0)  # the benchmark convnet: float32 running statistics, int64 counters


def workload(buffers: tuple[float, ...] = BN) -> Workload:
    return Workload(parameters=1000, grad_dtype="float32", forward=0.010, backward=0.020,
                    buckets=(Bucket(4000, 0.020),), device="cpu", buffer_broadcasts=buffers)


def test_broadcast_formulas():
    s = 8e6
    assert tree_broadcast(s, 1, LINK).seconds == 0 == chain_broadcast(s, 1, LINK).seconds
    # Binomial tree: ceil(log2 n) rounds of the whole message; chain: (n-1) hops, bytes once.
    assert tree_broadcast(s, 5, LINK).seconds == pytest.approx(3 * (ALPHA + s / BETA))
    assert chain_broadcast(s, 5, LINK).seconds == pytest.approx(4 * ALPHA + s / BETA)
    topo = Topology(LINK, 8)
    assert collective("broadcast", 1e3, 8, topo).algorithm == "tree"  # latency-bound: log n
    assert collective("broadcast", 1e9, 8, topo).algorithm == "ring"  # bandwidth-bound: chain
    assert collective("broadcast", 1e3, 2, topo).seconds == pytest.approx(ALPHA + 1e3 / BETA)


def test_ddp_pays_one_broadcast_per_message_before_forward():
    opts = PlanOptions(codec_bandwidth=1e30)
    ddp = parse_strategy("ddp")
    without = predict(workload(()), Topology(LINK, 3), 2, ddp, opts)
    at2 = predict(workload(), Topology(LINK, 3), 2, ddp, opts)
    at3 = predict(workload(), Topology(LINK, 3), 3, ddp, opts)
    assert without is not None and at2 is not None and at3 is not None
    # World 2: one hop per message; world 3: two hops per message (a chain: the tree's two
    # rounds would send the bytes twice).
    want2 = 2 * ALPHA + sum(BN) / BETA
    want3 = 2 * 2 * ALPHA + sum(BN) / BETA
    assert at2.detail["buffer_broadcast_s"] == pytest.approx(want2)
    assert at3.detail["buffer_broadcast_s"] == pytest.approx(want3)
    # Nothing hides it: the step and the exposed communication both grow by all of it.
    assert at2.step_s - without.step_s == pytest.approx(want2)
    assert at2.exposed_comm_s - without.exposed_comm_s == pytest.approx(want2)
    assert at2.comm_s - without.comm_s == pytest.approx(want2)
    # One rank sends nothing.
    alone = predict(workload(), Topology(LINK, 3), 1, ddp, opts)
    assert alone is not None and alone.step_s == pytest.approx(workload().compute)


def test_which_strategies_broadcast_buffers():
    opts = PlanOptions(codec_bandwidth=1e30)
    topo = Topology(LINK, 4)
    cost = 2 * ALPHA + sum(BN) / BETA
    for name, paid in (("ddp", True), ("ddp-bf16", True), ("compress:0.5", True),
                       ("zero1", True), ("localsgd:4", True), ("zero2", False), ("zero3", False)):
        with_bn = predict(workload(), topo, 2, parse_strategy(name), opts)
        bare = predict(workload(()), topo, 2, parse_strategy(name), opts)
        assert with_bn is not None and bare is not None
        assert with_bn.step_s - bare.step_s == pytest.approx(cost if paid else 0.0, abs=1e-12), name
    # DataParallel copies the buffers along with the parameters when it replicates.
    dp_bn = predict(workload(), topo, 2, parse_strategy("dp"), opts)
    dp_bare = predict(workload(()), topo, 2, parse_strategy("dp"), opts)
    assert dp_bn is not None and dp_bare is not None
    assert dp_bn.step_s - dp_bare.step_s == pytest.approx(sum(BN) / BETA)


def _doc(model_extra: dict) -> dict:
    return {
        "format": "lockstep-profile", "version": 1, "world_size": 1, "device": "cpu",
        "batch_size_per_rank": 8,
        "model": {"parameters": 1000, "trainable_parameters": 1000, "dtype": "float32",
                  **model_extra},
        "phases": {"forward": 0.01, "backward": 0.02, "step": 0.03},
    }


@pytest.mark.parametrize("extra, want, noted", [
    ({"buffers": 9, "buffer_bytes": 1816, "buffer_broadcasts": [1792, 24]}, BN, False),
    ({"buffer_bytes": 1816}, (1816.0,), False),  # only the total: one message
    ({"buffers": 0, "buffer_bytes": 0, "buffer_broadcasts": []}, (), False),
    ({}, (), True),  # a profile from before the field: still loads, and says so
])
def test_profile_buffer_fields(tmp_path, extra, want, noted):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_doc(extra)))
    w = load_profile(path)
    assert w.buffer_broadcasts == want
    assert any("buffer" in n for n in w.notes) == noted


def test_bad_buffer_field_names_file_and_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_doc({"buffer_broadcasts": ["lots"]})))
    with pytest.raises(ProfileError, match=r"bad\.json.*model\.buffer_broadcasts"):
        load_profile(path)
    with pytest.raises(ValueError, match="buffer"):
        replace(workload(), buffer_broadcasts=(-1.0,))


def test_what_if_buffer_bytes(capsys):
    w = describe(25e6, step_time=0.3, dtype="float32", buffer_bytes=40e3)
    assert w.buffer_broadcasts == (40e3,)
    assert describe(25e6, step_time=0.3).buffer_broadcasts == ()
    result = plan(w, Topology(LINK, 8), [2], "ddp")
    assert result.predictions[0].detail["buffer_broadcast_s"] == pytest.approx(ALPHA + 40e3 / BETA)
    assert any("buffers" in a for a in result.assumptions)
    assert main(["plan", "--params", "25M", "--step-time", "0.3", "--dtype", "float32",
                 "--buffer-bytes", "40k", "--link", "1ms@1GB/s:8", "--gpus", "2",
                 "--strategies", "ddp", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["buffer_broadcasts"] == [40e3]
    assert doc["predictions"][0]["detail"]["buffer_broadcast_s"] == pytest.approx(ALPHA + 40e3 / BETA)


def _bn_profile_worker(rank: int) -> list[dict]:
    import torch
    from torch import nn

    import lockstep
    from lockstep.doctor.api import gather_report

    lockstep.init_distributed()
    out = []
    for broadcast in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
        model = lockstep.DistributedDataParallel(net, broadcast_buffers=broadcast)
        recorder = model.enable_profiling(warmup=0)
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
        out.append(gather_report(recorder)["model"])
    return out


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_doctor_records_the_buffers_ddp_broadcasts():
    from lockstep.multiproc import spawn

    synced, kept = spawn(_bn_profile_worker, 1, (), timeout=100)[0]
    # BatchNorm1d(32): running mean and variance (float32, one message), num_batches_tracked
    # (int64, a second message).
    assert synced["buffers"] == 3 and synced["buffer_bytes"] == 2 * 32 * 4 + 8
    assert synced["buffer_broadcasts"] == [2 * 32 * 4, 8]
    assert kept["buffer_bytes"] == synced["buffer_bytes"] and kept["buffer_broadcasts"] == []
