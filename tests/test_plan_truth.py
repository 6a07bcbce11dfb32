"""The planner's realistic terms: transports, the slowest of N, intervals (pure logic, no timing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.plan import describe, parse_link, parse_strategy, parse_topology, plan
from lockstep.plan.intervals import INPUTS, predict_interval
from lockstep.plan.model import PlanOptions, predict
from lockstep.plan.stragglers import (
    expected_max_empirical,
    expected_max_normal,
    spread_of,
    straggler_delay,
)
from lockstep.plan.transports import TRANSPORTS, Transport, achievable, efficiency_at, transport_of


def test_expected_max_normal_matches_tables():
    # Harter (1961): E[max] of 2, 3, 4, 10 standard normals.
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(0.5642, abs=1e-4)
    assert expected_max_normal(3) == pytest.approx(0.8463, abs=1e-4)
    assert expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)
    assert expected_max_normal(10) == pytest.approx(1.5388, abs=1e-4)
    assert expected_max_normal(64) > expected_max_normal(16) > expected_max_normal(4)


def test_expected_max_empirical_is_exact():
    assert expected_max_empirical([3.0, 1.0, 2.0], 1) == pytest.approx(2.0)
    assert expected_max_empirical([1.0, 2.0], 2) == pytest.approx(1.75)  # 1/4 * 1 + 3/4 * 2
    assert expected_max_empirical([1.0, 2.0], 50) == pytest.approx(2.0, abs=1e-12)
    with pytest.raises(ValueError):
        expected_max_empirical([], 3)


def test_spread_and_delay():
    assert spread_of([1.0]) is None
    assert spread_of([1.0, 1.0]) == 0.0
    assert spread_of([0.9, 1.1]) == pytest.approx(0.1414, abs=1e-4)
    assert straggler_delay(0.1, 1, 0.05) == 0.0
    assert straggler_delay(0.1, 4, 0.05) == pytest.approx(0.1 * 0.05 * 1.0294, rel=1e-3)
    with pytest.raises(ValueError, match="cv"):
        straggler_delay(0.1, 4, -0.1)


def test_presets_name_their_transport():
    assert transport_of(parse_link("eth25")).name == "tcp"
    assert transport_of(parse_link("roce25")).name == "rdma"
    assert transport_of(parse_link("ib-ndr400")).name == "rdma"
    assert transport_of(parse_link("nvlink4")).name == "nvlink"
    assert transport_of(parse_link("5us@25GB/s")) is None  # a literal is what was achieved


def test_tcp_and_rdma_differ_on_the_same_port():
    eth, roce = parse_link("eth25"), parse_link("roce25")
    assert eth.beta == roce.beta  # the same line rate ...
    for size in (1e5, 1e6, 25e6):  # ... but not the same achievable bandwidth
        assert efficiency_at(eth, size) < efficiency_at(roce, size)
    # The curve rises with message size towards the transport's large-message efficiency.
    sizes = [1e3, 1e5, 1e7, 1e9]
    effs = [efficiency_at(roce, s) for s in sizes]
    assert effs == sorted(effs) and effs[-1] == pytest.approx(TRANSPORTS["rdma"].efficiency[1],
                                                              rel=0.01)
    assert efficiency_at(parse_link("5us@25GB/s"), 1e6) == 1.0


def test_transport_bounds_are_ordered():
    with pytest.raises(ValueError, match="efficiency"):
        Transport("x", (0.9, 0.5, 1.0), (0, 0, 0), "")
    topo = parse_topology("pcie3:4,roce25x1")
    fast, pm_fast = achievable(topo, "optimistic")
    slow, pm_slow = achievable(topo, "pessimistic")
    assert fast.inter.beta > slow.inter.beta and pm_fast < pm_slow
    with pytest.raises(ValueError, match="bound"):
        achievable(topo, "median")


def _cnn() -> object:
    return describe(25e6, step_time=0.25, batch_size=32, dtype="float32")


def test_bound_none_keeps_the_line_rate_model():
    w, topo, ddp = _cnn(), parse_topology("pcie3:4,eth25x1"), parse_strategy("ddp")
    plain = predict(w, topo, 16, ddp)
    real = predict(w, topo, 16, ddp, PlanOptions(bound="expected"))
    assert plain.detail["straggler_s"] == 0.0 and plain.detail["per_message_s"] == 0.0
    assert real.step_s > plain.step_s  # the line-rate model is a lower bound
    assert real.detail["straggler_s"] > 0 and real.detail["per_message_s"] > 0


def test_wait_for_slowest_grows_with_n_and_uses_the_profile_spread():
    w, topo, ddp = _cnn(), parse_topology("nvlink4:8,ib-ndr400"), parse_strategy("ddp")
    waits = [predict(w, topo, n, ddp, PlanOptions(bound="expected", step_cv=0.02))
             .detail["straggler_s"] for n in (2, 16, 128)]
    assert waits[0] < waits[1] < waits[2]
    assert waits[1] == pytest.approx(w.compute * 0.02 * expected_max_normal(16), rel=1e-6)
    from dataclasses import replace

    noisy = replace(w, step_cv=0.05)
    assert predict(noisy, topo, 16, ddp, PlanOptions(bound="expected")).detail[
        "straggler_s"] == pytest.approx(w.compute * 0.05 * expected_max_normal(16), rel=1e-6)


def test_interval_brackets_the_expected_and_names_the_dominant_input():
    w, ddp = _cnn(), parse_strategy("ddp")
    # A steady fleet (spread 0.5-3%): the link is the widest input on TCP.
    steady = PlanOptions(default_cv=(0.005, 0.015, 0.03))
    i = predict_interval(w, parse_topology("pcie3:4,eth25x1"), 32, ddp, steady)
    assert i.step_low_s <= i.expected.step_s <= i.step_high_s
    assert i.efficiency_low <= i.expected.efficiency <= i.efficiency_high
    assert i.dominant in INPUTS and set(i.swings) == set(INPUTS)
    assert i.dominant == "link efficiency"  # TCP's range (0.32-0.92) is the widest input
    # On a fast link the communication hides and the spread of the ranks dominates.
    j = predict_interval(w, parse_topology("nvlink4:8,ib-ndr400"), 64, ddp, steady)
    assert j.dominant == "step-time spread"


def test_best_is_chosen_on_the_pessimistic_end():
    w = _cnn()
    result = plan(w, parse_topology("pcie3:4,eth25x1"), [16], ["ddp", "ddp-bf16"],
                  intervals=True)
    rows = [p for p in result.predictions if p.gpus == 16]
    best = [p for p in rows if p.best]
    assert len(best) == 1
    worst = {p.strategy: p.samples_per_s * p.step_s / p.detail["step_high_s"] for p in rows}
    assert best[0].strategy == max(worst, key=lambda k: worst[k])
    assert "eff " in result.table() and "range from" in result.table()
    assert "efficiency_low" in result.to_dict()["predictions"][0]["detail"]


def test_nccl_algorithms_only_bound_ring_by_the_node_ports():
    from lockstep.plan.costs import ALL_REDUCE, collective

    topo = parse_topology("nvlink3:8,ib-hdr200x4")  # 4 x 25 GB/s leave each node
    size, n = 2**30, 16
    with_hier = collective(ALL_REDUCE, size, n, topo)
    nccl = collective(ALL_REDUCE, size, n, topo, hierarchical=False)
    assert with_hier.algorithm == "hierarchical" and nccl.algorithm in ("ring", "tree")
    busbw = size / nccl.seconds * 2 * (n - 1) / n
    assert busbw <= topo.node_bandwidth() * 1.0001  # a ring crosses the node through its NICs
    assert size / with_hier.seconds * 2 * (n - 1) / n > topo.node_bandwidth()


def test_published_rows_carry_their_citation():
    import json

    doc = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "published"
                      / "busbw.json").read_text())
    for row in doc["rows"]:
        assert row["url"].startswith("https://") and row["quote"] and row["user_knew"]
        parse_topology(row["link"])  # what a user would pass to --link
    sources = {f["source"] for f in doc["calibration"]["facts"]}
    assert sources <= {r["source"] for r in doc["rows"]} | {
        "NVIDIA/nccl#209", "NVIDIA/nccl#1639", "NCCL src/graph/topo.h"}


def test_transport_efficiency_ranges_are_the_min_median_max_of_the_cited_facts():
    import json
    import statistics

    doc = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "published"
                      / "busbw.json").read_text())
    for name in ("tcp", "rdma", "pcie"):
        values = sorted(v for f in doc["calibration"]["facts"] if f["transport"] == name
                        for v in f["efficiency"])
        lo, mid, hi = TRANSPORTS[name].efficiency
        assert (lo, hi) == (values[0], values[-1])
        assert mid == pytest.approx(statistics.median(values), abs=0.006)
    # PCIe: NCCL's own 3/4 of the line (topo.h's PCI_BW 12 of 15.75 GB/s) is the high end.
    assert TRANSPORTS["pcie"].efficiency[2] == pytest.approx(12 / 15.75, abs=0.005)


def test_profile_per_rank_phases_give_the_spread(tmp_path):
    import json

    from lockstep.plan import load_profile

    doc = {"format": "lockstep-profile", "version": 1, "world_size": 2, "device": "cpu",
           "batch_size_per_rank": 8, "steps": 10,
           "model": {"parameters": 1000, "dtype": "float32"},
           "phases": {"data": 0.0, "forward": 0.01, "backward": 0.02, "optimizer": 0.0,
                      "exposed_comm": 0.0, "step": 0.03},
           "per_rank": [{"rank": 0, "phases": {"forward": 0.009, "backward": 0.018}},
                        {"rank": 1, "phases": {"forward": 0.011, "backward": 0.022}}]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    w = load_profile(str(path))
    assert w.step_cv == pytest.approx(spread_of([0.027, 0.033]))
    doc.pop("per_rank")
    path.write_text(json.dumps(doc))
    assert load_profile(str(path)).step_cv is None


def test_report_does_not_import_the_planner():
    """plan/report.py renders through a Protocol: no import (even under TYPE_CHECKING) of the
    planner, which imports it, so the two modules form no cycle."""
    import ast

    from lockstep.plan import report

    tree = ast.parse(Path(report.__file__).read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "lockstep.plan.planner" not in names


def test_default_spread_is_an_option_used_only_without_a_measured_one():
    from dataclasses import replace

    w, topo, ddp = _cnn(), parse_topology("nvlink4:8,ib-ndr400"), parse_strategy("ddp")
    wide = PlanOptions(bound="pessimistic", default_cv=(0.0, 0.05, 0.2))
    wait = predict(w, topo, 16, ddp, wide).detail["straggler_s"]
    assert wait == pytest.approx(w.compute * 0.2 * expected_max_normal(16), rel=1e-6)
    measured = replace(w, step_cv=0.01)  # a profile's own spread wins over the default
    assert predict(measured, topo, 16, ddp, wide).detail["straggler_s"] == pytest.approx(
        w.compute * 0.01 * expected_max_normal(16), rel=1e-6)
    with pytest.raises(ValueError, match="default_cv"):
        PlanOptions(default_cv=(0.1, 0.05, 0.2))


def _published_scaling() -> list[dict]:
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published" / "training_scaling.json"
    return json.loads(path.read_text())["rows"]


def test_published_scaling_rows_are_read_from_their_quotes():
    """Every training-scaling row cites its README and table, and its numbers appear in the
    quoted table rows; the efficiency is the published scaling column over the GPU count."""
    rows = _published_scaling()
    assert len(rows) >= 30 and len({r["url"].split("/blob/")[0] for r in rows}) >= 4
    for row in rows:
        assert row["url"].startswith(("https://github.com/NVIDIA/DeepLearningExamples/",
                                      "https://github.com/Oneflow-Inc/DLPerf/",
                                      "https://github.com/tensorflow/docs/",
                                      "https://github.com/lambdal/deeplearning-benchmark/",
                                      "https://github.com/pytorch/pytorch/"))
        tail = row["quote"].split(" ... ")[-1]
        quoted = row.get("throughput_per_gpu_n", row["throughput_n"])  # a per-GPU column
        assert quoted * row["gpus"] == row["throughput_n"] or "throughput_per_gpu_n" not in row
        assert str(quoted) in tail and str(row["throughput_1gpu"]) in row["quote"]
        if "column" not in row:  # a README's own scaling column, quoted
            assert str(row["published_scaling"]) in tail
        assert row["efficiency"] == pytest.approx(row["published_scaling"] / row["gpus"], abs=1e-4)
        assert row["user_knew"]


def test_implied_spread_closes_the_gap_it_was_read_from():
    """bench_plan_scaling.implied_cv inverts the slowest-of-N term: a row whose published
    efficiency is the prediction at spread c implies c."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan_scaling.py"
    spec = importlib.util.spec_from_file_location("bench_plan_scaling", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = dict(_published_scaling()[4])
    params = {row["model"]: 25_000_000}
    row["efficiency"] = bench.predict_row(row, params, cv=0.04)["predicted"]
    assert bench.implied_cv(row, params) == pytest.approx(0.04, rel=1e-3)
    row["efficiency"] = 1.5  # better than the no-spread prediction: no spread, not a negative one
    assert bench.implied_cv(row, params) == 0.0


@pytest.mark.slow  # reruns the whole published-set calibration (bench_plan_scaling.py shows it too)
def test_default_spread_is_the_min_median_max_over_every_published_row():
    """DEFAULT_CV is bench_plan_scaling.calibrated_cv over all the published rows, to three decimals."""
    import importlib.util

    from lockstep.plan.stragglers import DEFAULT_CV

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan_scaling.py"
    spec = importlib.util.spec_from_file_location("bench_plan_scaling", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    params = {name: count() for name, count in bench.MODELS.items()}
    got = bench.calibrated_cv(_published_scaling(), params)
    assert DEFAULT_CV == pytest.approx(got, abs=5e-4)
