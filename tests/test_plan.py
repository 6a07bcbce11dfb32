"""The planner's pure logic: links, collective costs, bucket overlap, memory, profiles, CLI."""

from __future__ import annotations

import contextlib
import json
import math
import sys
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
    fit_alpha_beta,
    load_profile,
    model_state_memory,
    parse_link,
    parse_strategy,
    parse_topology,
    plan,
    predict,
    simulate_buckets,
)
from lockstep.plan.costs import ring_allreduce, tree_allreduce
from lockstep.plan.workload import MB, synthetic_buckets

GB = 1e9


def profile_doc(**over) -> dict:
    doc = {
        "format": "lockstep-profile", "version": 1, "world_size": 1, "backend": "gloo",
        "device": "cpu", "mode": "ddp", "batch_size_per_rank": 16, "steps": 30,
        "model": {"parameters": 1_000_000, "trainable_parameters": 1_000_000,
                  "param_bytes": 4_000_000, "grad_bytes": 4_000_000, "dtype": "float32"},
        "phases": {"data": 0.001, "forward": 0.010, "backward": 0.020, "exposed_comm": 0.0,
                   "optimizer": 0.003, "step": 0.034},
        "buckets": [{"index": 0, "bytes": 1_000_000, "params": ["b"], "ready": 0.005,
                     "allreduce": 0.001, "busbw": 1e9},
                    {"index": 1, "bytes": 3_000_000, "params": ["a"], "ready": 0.020}],
        "per_rank": [], "a_field_from_the_future": {"x": 1},
    }
    doc.update(over)
    return doc


# ---- links -------------------------------------------------------------------------------
def test_presets_and_literals():
    assert parse_link("ib-ndr400").beta == pytest.approx(50e9)
    assert parse_link("NVLink4").beta == pytest.approx(450e9)
    assert parse_link("ndr") == parse_link("ib-ndr400")
    lit = parse_link("5us@12.5GB/s")
    assert lit.alpha == pytest.approx(5e-6) and lit.beta == pytest.approx(12.5e9)
    assert parse_link("2ms@100Gbit/s").beta == pytest.approx(12.5e9)
    with pytest.raises(ValueError, match="ib-ndr400"):  # the error lists the presets
        parse_link("infiniband9000")
    with pytest.raises(ValueError, match="--measure-link"):
        parse_link("measured")


def test_topology_spec():
    t = parse_topology("nvlink4:8,ib-ndr400")
    assert (t.gpus_per_node, t.intra.name, t.inter.name, t.nics) == (8, "nvlink4", "ib-ndr400", 8)
    assert t.node_bandwidth() == pytest.approx(400e9)
    t = parse_topology("pcie3:4,roce25x1")
    assert (t.gpus_per_node, t.nics) == (4, 1) and t.node_bandwidth() == pytest.approx(25e9 / 8)
    assert parse_topology("roce100").gpus_per_node == 1
    measured = Link("measured", 1e-4, 1e9)
    assert parse_topology("measured:4,eth10", {"measured": measured}).intra is measured
    with pytest.raises(ValueError, match="integer"):
        parse_topology("nvlink4:eight")
    with pytest.raises(ValueError):
        Link("bad", 1e-6, 0.0)


# ---- collectives -------------------------------------------------------------------------
def test_ring_and_tree_formulas():
    link = Link("l", 10e-6, 1e9)
    s = 8e6
    assert ring_allreduce(s, 1, link).seconds == 0
    assert ring_allreduce(s, 4, link).seconds == pytest.approx(6 * 10e-6 + 1.5 * s / 1e9)
    assert tree_allreduce(s, 8, link).seconds == pytest.approx(6 * 10e-6 + 2 * s / 1e9)
    # Small messages on many ranks: the tree's log(n) latency wins; big ones: the ring's bytes.
    topo = Topology(link, 1)
    assert collective("all_reduce", 1e3, 1024, topo).algorithm == "tree"
    assert collective("all_reduce", 1e9, 4, topo).algorithm == "ring"


def test_hierarchical_beats_flat_ring_latency_across_nodes():
    topo = parse_topology("nvlink4:8,ib-ndr400")
    cost = collective("all_reduce", 1e6, 512, topo)
    flat = ring_allreduce(1e6, 512, Link("x", 5e-6, 400e9))
    assert cost.seconds < flat.seconds
    assert cost.bound_by == "inter"
    # Inside one node only the inside link counts.
    assert collective("all_reduce", 1e9, 8, topo).bound_by == "intra"
    with pytest.raises(ValueError, match="all_reduce"):
        collective("all_to_all", 1.0, 4, topo)


# ---- bucket overlap ----------------------------------------------------------------------
def test_bucket_queue_starts_at_max_of_ready_and_previous_done():
    # ready 1, 2, 10; cost 3 each: 1->4, max(2,4)=4->7, max(10,7)=10->13.
    assert simulate_buckets([1, 2, 10], [3, 3, 3]) == [(1, 4), (4, 7), (10, 13)]
    # Encode delays the start, decode the end.
    assert simulate_buckets([0], [1], [0.5], [0.25]) == [(0.5, 1.75)]


def test_last_bucket_is_always_exposed():
    w = Workload(parameters=1000, grad_dtype="float32", forward=1.0, backward=2.0,
                 buckets=(Bucket(2e6, 1.0), Bucket(2e6, 2.0)))
    link = Link("slow", 0.0, 1e6)  # 2 MB all-reduce on 2 ranks: 2 s
    p = predict(w, Topology(link, 2), 2, parse_strategy("ddp"), PlanOptions(codec_bandwidth=1e30))
    # bucket 0: 1 -> 3; bucket 1: max(2, 3) -> 5; backward ends at 2: 3 s exposed.
    assert p.exposed_comm_s == pytest.approx(3.0)
    assert p.step_s == pytest.approx(1 + 2 + 3)
    assert p.efficiency == pytest.approx(3 / 6)
    assert p.binding == "intra-node bandwidth"


def test_compression_scales_bytes_and_adds_codec_time():
    w = Workload(parameters=1000, grad_dtype="float32", forward=1.0, backward=2.0, device="cpu",
                 buckets=(Bucket(2e6, 2.0),))
    topo = Topology(Link("slow", 0.0, 1e6), 2)
    full = predict(w, topo, 2, parse_strategy("ddp"), PlanOptions(codec_bandwidth=4e6))
    half = predict(w, topo, 2, parse_strategy("ddp-bf16"), PlanOptions(codec_bandwidth=3e6))
    # Plain: 2 MB sent (2 s) + the copies into and out of the bucket, 4 MB each at 4 MB/s (1 s each).
    assert full.exposed_comm_s == pytest.approx(4.0)
    # Compressed: 1 MB sent (1 s) + encode and decode of 3 MB each at 3 MB/s (1 s each).
    assert half.exposed_comm_s == pytest.approx(3.0)


def test_input_layer_is_a_last_bucket_ready_at_the_end_of_backward():
    from lockstep.plan.workload import MB, synthetic_buckets

    # 60 MB of gradients, 20 MB of them the input layer's: 40 MB arrive at a constant rate
    # (1 MB first, then 25 MB, then the 14 MB rest), then one 20 MB bucket at the end.
    b = synthetic_buckets(60 * MB, 0.6, last_bytes=20 * MB)
    assert [x.nbytes / MB for x in b] == pytest.approx([1, 25, 14, 20])
    assert [x.ready for x in b] == pytest.approx([0.6 / 40, 0.6 * 26 / 40, 0.6, 0.6])
    assert synthetic_buckets(60 * MB, 0.6) == synthetic_buckets(60 * MB, 0.6, last_bytes=0)
    with pytest.raises(ValueError, match="last_bytes"):
        synthetic_buckets(1 * MB, 0.6, last_bytes=2 * MB)
    # describe(): the input layer's parameters at the gradient dtype's width.
    w = describe(10e6, step_time=0.3, dtype="float32", input_parameters=4e6)
    assert sum(x.nbytes for x in w.buckets) == pytest.approx(40e6)
    assert w.buckets[-1] == Bucket(16e6, pytest.approx(0.2))
    assert describe(10e6, step_time=0.3).buckets == describe(10e6, step_time=0.3,
                                                              input_parameters=0).buckets
    with pytest.raises(ValueError, match="input_parameters"):
        describe(10e6, step_time=0.3, input_parameters=11e6)


def test_the_input_layer_cannot_hide_so_it_adds_its_whole_all_reduce():
    topo = Topology(Link("slow", 0.0, 1e9), 2)
    free = PlanOptions(codec_bandwidth=1e18)  # no bucket copies: the link alone
    uniform = predict(describe(100e6, step_time=3.0, dtype="float32"), topo, 2,
                      parse_strategy("ddp"), free)
    tail = predict(describe(100e6, step_time=3.0, dtype="float32", input_parameters=25e6),
                   topo, 2, parse_strategy("ddp"), free)
    # Ring all-reduce at n = 2 moves S bytes at 1 GB/s: each bucket is done before the next is
    # ready, but the 100 MB input layer (0.1 s) and the rest of the 300 MB before it (300 MB -
    # 276 MiB, ready at the same moment) start only when backward ends.
    from lockstep.plan.workload import MB

    rest = 300e6 - 276 * MB
    assert tail.exposed_comm_s == pytest.approx((rest + 100e6) / 1e9, rel=1e-6)
    assert uniform.exposed_comm_s < tail.exposed_comm_s


def test_cli_input_params_prices_the_last_bucket(capsys):
    args = ["plan", "--params", "100M", "--step-time", "3", "--dtype", "float32", "--link",
            "0us@1GB/s:2", "--gpus", "2", "--strategies", "ddp", "--no-intervals", "--json", "-"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["predictions"][0]
    assert main(args + ["--input-params", "25M"]) == 0
    tail = json.loads(capsys.readouterr().out)["predictions"][0]
    # The 100 MB input layer's all-reduce (0.1 s at 1 GB/s, n = 2) is exposed on top.
    assert tail["exposed_comm_s"] - plain["exposed_comm_s"] > 0.09


def test_local_sgd_amortises_and_dp_stays_in_one_node():
    w = describe(1e6, step_time=0.3, dtype="float32")
    topo = parse_topology("pcie4:4,eth10x1")
    every = predict(w, topo, 8, parse_strategy("localsgd:1"))
    sparse = predict(w, topo, 8, parse_strategy("localsgd:10"))
    assert sparse.exposed_comm_s == pytest.approx(every.exposed_comm_s / 10)
    assert not sparse.exact and parse_strategy("ddp").exact
    assert predict(w, topo, 8, parse_strategy("dp")) is None
    assert predict(w, topo, 4, parse_strategy("dp")).exposed_comm_s > 0
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategy("fsdp")


# ---- memory ------------------------------------------------------------------------------
def test_zero_memory_matches_the_paper():
    # ZeRO paper, Figure 1: psi = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    psi, n = 7.5e9, 64
    got = [model_state_memory(psi, n, s, mixed_precision=True).total / GB for s in range(4)]
    assert got == pytest.approx([120, 31.40625, 16.640625, 1.875])
    assert got[0] == pytest.approx(16 * psi / GB)
    fp32 = model_state_memory(psi, n, 2, mixed_precision=False)
    assert fp32.parameters == 4 * psi and fp32.gradients == pytest.approx(4 * psi / n)
    assert fp32.optimizer == pytest.approx(8 * psi / n)
    assert model_state_memory(psi, n, 0, mixed_precision=False, optimizer="sgd").optimizer == 0


# ---- profiles ----------------------------------------------------------------------------
def test_load_profile_reads_the_format_and_ignores_extra_fields(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_doc()))
    w = load_profile(path)
    assert (w.parameters, w.grad_dtype, w.batch_size) == (1_000_000, "float32", 16)
    assert [b.nbytes for b in w.buckets] == [1_000_000, 3_000_000]
    assert w.compute == pytest.approx(0.034)


@pytest.mark.parametrize("drop, field", [("phases", "'phases'"), ("model", "'model'"),
                                         ("format", "'format'")])
def test_bad_profile_names_file_and_field(tmp_path, drop, field):
    doc = profile_doc()
    del doc[drop]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=rf"broken\.json.*{field}"):
        load_profile(path)
    doc = profile_doc()
    del doc["phases"]["backward"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"phases\.'backward'"):
        load_profile(path)


def test_a_directory_given_as_the_profile_is_named(tmp_path):
    with pytest.raises(ProfileError, match="is a directory, not a profile file"):
        load_profile(tmp_path)


def test_what_if_settings_that_would_not_be_used_are_refused(tmp_path, capsys):
    """With a profile the what-if settings are measured; with --step-time, --mfu is not used.
    Both were ignored without a word."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_doc()))
    assert main(["plan", str(path), "--dtype", "fp16", "--gpus", "8", "--strategies", "ddp"]) == 2
    assert "--dtype: what-if settings, which a profile replaces" in capsys.readouterr().err
    assert main(["plan", "--params", "125M", "--step-time", "0.1", "--mfu", "0.5", "--gpus", "8"]) == 2
    assert "with a measured --step-time it would not be used" in capsys.readouterr().err
    assert main(["plan", "--params", "125M", "--step-time", "0.1", "--link", "", "--gpus", "8"]) == 2
    assert "--link is empty" in capsys.readouterr().err


def test_profile_without_buckets_gets_synthetic_ones(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_doc(buckets=[])))
    w = load_profile(path)
    assert sum(b.nbytes for b in w.buckets) == pytest.approx(4_000_000)
    assert w.buckets[-1].ready == pytest.approx(0.020) and w.notes


def test_fit_recovers_alpha_and_beta():
    alpha, beta, n = 50e-6, 2e9, 3
    sizes = [1e4, 1e5, 1e6, 1e7]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta for s in sizes]
    link = fit_alpha_beta(sizes, times, n)
    assert link.alpha == pytest.approx(alpha) and link.beta == pytest.approx(beta)
    with pytest.raises(ValueError, match="noisy"):
        fit_alpha_beta([1, 2], [2.0, 1.0], 2)


# ---- plan and CLI ------------------------------------------------------------------------
def test_plan_marks_one_best_per_gpu_count():
    w = describe(1.3e9, step_time=0.45, batch_size=8, dtype="bfloat16")
    result = plan(w, parse_topology("nvlink4:8,ib-ndr400"), [8, 512],
                  options=PlanOptions(gpu_memory=16e9))
    for n in (8, 512):
        best = [p for p in result.predictions if p.gpus == n and p.best]
        assert len(best) == 1 and best[0].fits and best[0].exact
    assert all(not p.fits for p in result.predictions if p.strategy == "ddp")  # 20.8 GB > 16
    assert all(math.isfinite(p.step_s) and 0 < p.efficiency <= 1 for p in result.predictions)
    assert "Not modelled" in result.table() and "stragglers" in result.table()


def test_cli_profile_to_table_json_png(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_doc()))
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", str(path), "--gpus", "8,64", "--link", "pcie4:4,roce100",
               "--strategies", "ddp,zero2,localsgd:4", "--json", str(out_json), "--png", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "*ddp" in text or "*zero2" in text
    doc = json.loads(out_json.read_text())
    assert doc["format"] == "lockstep-plan" and len(doc["predictions"]) == 6
    assert out_png.stat().st_size > 10_000


def test_cli_what_if_and_errors(capsys):
    assert main(["plan", "--params", "125M", "--flops-per-sample", "1e12", "--gpu-tflops", "989",
                 "--batch-size", "16", "--gpus", "8", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["parameters"] == 125_000_000
    assert main(["plan", "--gpus", "8"]) == 2
    assert "--params" in capsys.readouterr().err
    assert main(["plan", "missing.json"]) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, text", [
    (["--params", "inf", "--step-time", "0.1"], "argument --params: 'inf' is not a positive finite"),
    (["--params", "125M", "--step-time", "nan"], "argument --step-time: 'nan' is not a positive"),
    (["--params", "125M", "--step-time", "0.1", "--batch-size", "-4"], "'-4' is not a positive integer"),
    (["--params", "125M", "--step-time", "0.1", "--gpu-memory", "0"], "argument --gpu-memory"),
    (["--params", "1e30", "--step-time", "0.1"], "at most 2e+12"),  # was a loop without end
    (["--params", "125M", "--step-time", "0.1", "--json", "no/such/dir/plan.json"],
     "cannot write --json no/such/dir/plan.json"),
])
def test_cli_refuses_values_it_cannot_price_naming_the_flag(argv, text, capsys):
    with contextlib.suppress(SystemExit):  # argparse's own errors exit with 2
        assert main(["plan", *argv, "--gpus", "8", "--strategies", "ddp"]) == 2
    assert text in capsys.readouterr().err


@pytest.mark.parametrize("change, text", [
    (lambda d: d["phases"].update(forward=None), "field phases.forward must be a finite number"),
    (lambda d: d["phases"].update(forward=float("nan")), "field phases.forward must be a finite"),
    (lambda d: d.update(model=[]), "field model must be an object"),
    (lambda d: d["model"].update(trainable_parameters="1M"), "model.trainable_parameters must be a whole"),
    (lambda d: d.update(batch_size_per_rank=0), "batch_size_per_rank must be a positive integer"),
    (lambda d: d.update(buckets=[{"bytes": None, "ready": 0.1}]), "buckets[0].bytes must be"),
    # found by an outside audit (2026-11-28): each was read as something else, silently
    (lambda d: d["model"].update(dtype="float8_e4m3fn"), "field model.dtype is 'float8_e4m3fn'"),
    (lambda d: d["model"].update(dtype=5), "field model.dtype is 5"),
    (lambda d: d["model"].update(buffer_broadcasts="12"), "model.buffer_broadcasts must be a list"),
    (lambda d: d.update(version=True), "profile version True"),
    (lambda d: d.update(world_size=0), "field world_size must be a whole number >= 1"),
    (lambda d: d.update(world_size="two"), "field world_size must be a whole number >= 1"),
    (lambda d: d["model"].update(trainable_parameters=0), "field model.trainable_parameters must be between 1"),
    (lambda d: d["model"].update(trainable_parameters=1e15), "field model.trainable_parameters must be between 1"),
    (lambda d: d.update(link={"alpha": 1e-5, "beta": 0}), "field link.beta must be > 0"),
    (lambda d: d.update(device=["cuda"]), "field device must be a string"),
    (lambda d: d["model"].update(buffer_bytes="abc"), "field model.buffer_bytes must be a finite number"),
    (lambda d: d.update(buckets=[5]), "buckets[0] must be an object, got 5"),
])
def test_profile_fields_of_the_wrong_kind_name_the_file_and_field(tmp_path, change, text):
    doc = profile_doc()
    change(doc)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert str(path) in str(caught.value) and text in str(caught.value)


def test_the_wait_for_the_slowest_rank_is_not_exposed_communication():
    w = describe(125e6, step_time=0.1, batch_size=8)
    result = plan(w, parse_topology("nvlink4:8,ib-ndr400"), [100_000], "ddp", intervals=True)
    (p,) = result.predictions
    wait = p.detail["straggler_s"]
    assert wait > 0.1 * p.step_s and p.exposed_comm_s < wait  # the wait is its own column
    assert p.binding == "the slowest of 100000 ranks"
    assert "every link delivers its stated bandwidth" not in result.table()  # ranged by default


def test_synthetic_buckets_are_counted_not_summed_on():
    buckets = synthetic_buckets(4e12, 1.0)  # 160,000 buckets; adding 25 MB to 4e12 still moves
    assert len(buckets) == 1 + math.ceil((4e12 - MB) / (25 * MB))
    assert buckets[-1].ready == 1.0 and sum(b.nbytes for b in buckets) == pytest.approx(4e12)


def test_cli_measure_link_puts_every_gpu_on_the_measured_link(tmp_path, capsys, monkeypatch):
    from lockstep.plan import measure

    calls = []

    def fake(nproc):
        calls.append(nproc)
        sizes = (10_000, 1_000_000)  # alpha 1 ms, beta 100 MB/s
        times = tuple(2 * (nproc - 1) * 1e-3 + 2 * (nproc - 1) / nproc * s / 1e8 for s in sizes)
        return measure.LinkSweep(nproc, sizes, (times, times), (times, times))

    monkeypatch.setattr(measure, "measure_link_sweep", fake)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_doc()))
    assert main(["plan", str(path), "--measure-link", "--nproc", "3", "--gpus", "2,3",
                 "--strategies", "ddp", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert calls == [3]
    assert doc["topology"]["intra"]["name"] == "measured" and doc["topology"]["gpus_per_node"] == 3
    # With --link, 'measured' is one of the link names.
    assert main(["plan", str(path), "--measure-link", "--link", "measured:2,eth10", "--gpus", "4",
                 "--strategies", "ddp", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["topology"]["intra"]["name"] == "measured"
    assert doc["topology"]["inter"]["name"] == "eth10"


def _world1_profile_worker(rank):
    import torch
    from torch import nn

    import lockstep
    from lockstep.doctor.api import gather_report

    lockstep.init_distributed()
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    recorder = model.enable_profiling(warmup=1)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return gather_report(recorder)


def test_doctor_profile_at_world_one_gives_the_buckets_ddp_would_send(tmp_path):
    """A world of one has no reducer, yet its profile lists DDP's buckets with ready times."""
    from lockstep.multiproc import spawn

    doc = spawn(_world1_profile_worker, 1, (), timeout=120)[0]
    assert doc["world_size"] == 1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    w = load_profile(path)
    assert w.parameters == 64 * 512 + 512 + 512 * 64 + 64 and w.batch_size == 8
    assert not w.notes  # measured buckets, not the synthetic fallback
    ready = [b["ready"] for b in doc["buckets"]]
    assert len(ready) > 1 and ready == sorted(ready)  # launch order = arrival order
    assert all(0 < r <= doc["phases"]["backward"] * 1.5 for r in ready)
    assert doc["buckets"][0]["params"][0] == "2.bias"  # the last layer's gradients come first
    assert doc["buckets"][-1]["last_param"] in ("0.weight", "0.bias")
    assert sum(b["bytes"] for b in doc["buckets"]) == w.grad_bytes
    assert all(b["allreduce"] == 0 and b["exposed"] == 0 for b in doc["buckets"])  # nothing sent


def test_cpu_ranks_time_share_the_cores():
    """With more CPU work than cores, the step is ranks x (compute + link) / cores, no overlap."""
    from lockstep.plan.links import Link, Topology
    from lockstep.plan.model import PlanOptions, predict
    from lockstep.plan.strategies import parse_strategy
    from lockstep.plan.workload import Bucket, Workload

    w = Workload(parameters=1_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, other=0.0, batch_size=8,
                 buckets=(Bucket(2e6, 0.005), Bucket(2e6, 0.020)), device="cpu")
    link = Link("loopback", 1e-4, 1e9)
    ddp = parse_strategy("ddp")
    plain = predict(w, Topology(link, 4), 2, ddp)
    one_each = predict(w, Topology(link, 4), 2, ddp, PlanOptions(cpu_cores=4))
    shared = predict(w, Topology(link, 4), 3, ddp, PlanOptions(cpu_cores=2))
    assert plain is not None and one_each is not None and shared is not None
    assert one_each.step_s == plain.step_s  # enough cores: the ordinary overlap model
    a_core_each = predict(w, Topology(link, 4), 2, ddp, PlanOptions(cpu_cores=2))
    assert a_core_each is not None and a_core_each.step_s == plain.step_s
    compute = 0.010 + 0.020 + 0.002
    copies = 2 * 2 * (2e6 + 2e6) / 5e9  # into and out of both buckets at 5 GB/s (CPU default)
    assert shared.step_s == pytest.approx(0.001 + 3 * (compute + shared.comm_s + copies) / 2)
    assert shared.binding == "cpu cores (3 ranks on 2)"
    assert shared.exposed_comm_s > plain.exposed_comm_s
    gpu = predict(replace(w, device="cuda"), Topology(link, 4), 3, ddp, PlanOptions(cpu_cores=2))
    assert gpu is not None and gpu.binding != shared.binding  # GPU profiles ignore cpu_cores
    with pytest.raises(ValueError, match="cpu_cores"):
        PlanOptions(cpu_cores=0)


def test_cli_png_without_matplotlib_skips_the_picture_only(tmp_path, capsys, monkeypatch):
    """matplotlib is optional (issue 25): --png without it prints the table and one line."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_doc()))
    out_png = tmp_path / "plan.png"
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    rc = main(["plan", str(path), "--gpus", "8,64", "--link", "pcie4:4,roce100",
               "--strategies", "ddp,zero2", "--png", str(out_png)])
    captured = capsys.readouterr()
    assert rc == 0 and ("*ddp" in captured.out or "*zero2" in captured.out)
    assert f"skipped {out_png}: matplotlib is not installed (pip install matplotlib)" in captured.err
    assert not out_png.exists()
