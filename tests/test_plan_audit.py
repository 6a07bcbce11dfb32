"""The planner's answers stay consistent with their mode and inputs (audit plan7, 2026-11-29).

Pure logic: no processes, no timing. Each test failed on the code before the fix it names.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lockstep.cli import main
from lockstep.plan import (
    Bucket,
    Link,
    PlanOptions,
    Topology,
    Workload,
    describe,
    load_profile,
    parse_strategy,
    parse_topology,
    plan,
    predict,
)
from lockstep.plan.intervals import NO_SWING, predict_interval
from lockstep.plan.model import codec_bandwidth


def _cpu_workload(**over) -> Workload:
    w = Workload(parameters=8_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, other=0.004, batch_size=8,
                 buckets=(Bucket(16e6, 0.010), Bucket(16e6, 0.020)), device="cpu")
    return replace(w, **over)


def _profile(tmp_path, **phases) -> str:
    doc = {"format": "lockstep-profile", "version": 1, "world_size": 1, "device": "cpu",
           "batch_size_per_rank": 16,
           "phases": {"data": 0.001, "forward": 0.010, "backward": 0.020, "optimizer": 0.003,
                      "step": 0.036},
           "model": {"trainable_parameters": 1_000_000, "dtype": "float32",
                     "buffer_broadcasts": []},
           "buckets": [{"bytes": 1e6, "ready": 0.005}, {"bytes": 3e6, "ready": 0.020}]}
    doc["phases"].update(phases.pop("phases", {}))
    doc.update(phases)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


# ---- 1. the optimistic copy rate --------------------------------------------------------------

def test_a_copy_rate_below_the_default_never_makes_the_optimistic_end_slower():
    w = _cpu_workload()
    slow = PlanOptions(bound="optimistic", copy_rate=0.5e9)
    assert codec_bandwidth(w, slow) == 5e9  # the faster of the measured copy and the default
    assert codec_bandwidth(w, replace(slow, copy_rate=30e9)) == 30e9
    topo = parse_topology("eth10")
    i = predict_interval(w, topo, 4, parse_strategy("ddp"), PlanOptions(copy_rate=0.5e9))
    assert i is not None
    optimistic = predict(w, topo, 4, parse_strategy("ddp"), slow)
    assert optimistic is not None and optimistic.step_s <= i.expected.step_s
    text = "\n".join(plan(w, topo, [4], "ddp", PlanOptions(copy_rate=0.5e9),
                          intervals=True).assumptions)
    assert "faster of" in text and "0.5 GB/s" in text


# ---- 2. what the collectives pick from, per mode ---------------------------------------------

def test_the_collectives_assumption_says_what_each_mode_prices():
    w = describe(1.3e9, step_time=0.45, batch_size=8, dtype="bfloat16")
    preset = parse_topology("nvlink4:8,ib-ndr400")
    ranged = "\n".join(plan(w, preset, [64], "ddp", intervals=True).assumptions)
    assert "cheaper of ring and tree" in ranged and "no hierarchical all-reduce" in ranged
    assert "as NCCL's tuner does" not in ranged
    line = "\n".join(plan(w, preset, [64], "ddp").assumptions)
    assert "ring, tree and a hierarchical schedule" in line and "line-rate lower bound" in line
    literal = parse_topology("5us@12.5GB/s:8,5us@12.5GB/s")
    lit = "\n".join(plan(w, literal, [64], "ddp", intervals=True).assumptions)
    assert "hierarchical schedule" in lit and "no preset link" in lit


# ---- 3. profiles the model cannot price -------------------------------------------------------

def test_a_profile_with_no_compute_is_refused_naming_the_file(tmp_path):
    path = _profile(tmp_path, phases={"data": 0, "forward": 0, "backward": 0, "optimizer": 0,
                                      "step": 0, "exposed_comm": 0.009})
    with pytest.raises(ValueError, match=r"profile\.json: fields phases\.forward and "
                                         r"phases\.backward are both 0"):
        load_profile(path)
    with pytest.raises(ValueError, match="both 0"):
        Workload(parameters=10, grad_dtype="float32", forward=0.0, backward=0.0)


def test_phases_that_overflow_are_refused_not_printed_as_inf(tmp_path, capsys):
    path = _profile(tmp_path, phases={"forward": 1e308, "backward": 1e308})
    assert main(["plan", path, "--gpus", "8", "--strategies", "ddp"]) == 2
    err = capsys.readouterr().err
    assert "profile.json: the phases sum to inf" in err and "Traceback" not in err
    w = _cpu_workload(forward=0.8e308, backward=0.8e308, optimizer=0.0, data=0.0, other=0.0)
    with pytest.raises(ValueError, match="too large to price"):  # finite inputs, inf step
        plan(w, parse_topology("eth10"), [4096], "ddp", intervals=True)


def test_a_bucket_ready_after_backward_is_clamped_with_a_note(tmp_path):
    path = _profile(tmp_path, buckets=[{"bytes": 1e6, "ready": 100.0},
                                       {"bytes": 3e6, "ready": 0.020}])
    w = load_profile(path)
    assert [b.ready for b in w.buckets] == [0.020, 0.020]
    assert any("clamped to the end of backward" in n and "buckets[0]" in n for n in w.notes)
    p = predict(w, parse_topology("eth10"), 8, parse_strategy("ddp"))
    assert p is not None and p.step_s < 1.0  # not the 100 s the raw ready time held it to


# ---- 4. DataParallel beyond one node ------------------------------------------------------------

def test_dp_beyond_one_node_is_named_and_nothing_left_is_an_error(capsys):
    w = describe(1.3e9, step_time=0.45, batch_size=8, dtype="bfloat16")
    topo = parse_topology("nvlink4:8,ib-ndr400")
    result = plan(w, topo, [8, 64], "dp,ddp")
    assert any("DataParallel) runs within one node of 8" in a and "64 GPUs are skipped" in a
               for a in result.assumptions)
    assert not any("are skipped" in a for a in plan(w, topo, [8, 64]).assumptions)  # not asked
    with pytest.raises(ValueError, match="nothing to predict.*within one node of 8"):
        plan(w, topo, [64], "dp")
    assert main(["plan", "--params", "1.3B", "--step-time", "0.45", "--strategies", "dp",
                 "--gpus", "64"]) == 2
    assert "nothing to predict" in capsys.readouterr().err


# ---- 5. --link-efficiency 1.0 given -------------------------------------------------------------

def test_an_explicit_link_efficiency_of_one_replaces_the_ranges(capsys):
    argv = ["plan", "--params", "1.3B", "--step-time", "0.45", "--strategies", "ddp",
            "--gpus", "64", "--json", "-"]
    assert main([*argv, "--link-efficiency", "1.0"]) == 0
    given = json.loads(capsys.readouterr().out)["predictions"][0]
    assert "efficiency_low" not in given["detail"]  # the line-rate model: no range
    assert main(argv) == 0
    assert "efficiency_low" in json.loads(capsys.readouterr().out)["predictions"][0]["detail"]


# ---- 6. bound="expected" alone ------------------------------------------------------------------

def test_a_bound_alone_reports_its_own_assumptions_and_spread():
    w = describe(1.3e9, step_time=0.45, batch_size=8, dtype="bfloat16")
    result = plan(w, parse_topology("nvlink4:8,ib-ndr400"), [64], "ddp",
                  PlanOptions(bound="expected"))
    assert not any(n.startswith("stragglers") for n in result.not_modelled)
    assert not any("stated bandwidth" in n for n in result.not_modelled)
    text = "\n".join(result.assumptions)
    assert "bound expected" in text and "spread 4.3%" in text
    assert "line-rate lower bound" not in text


# ---- 7. the range label and straggler_s ---------------------------------------------------------

def test_no_swing_is_not_called_link_efficiency():
    w = describe(1.3e9, step_time=0.45, batch_size=8, dtype="bfloat16")
    i = predict_interval(w, parse_topology("nvlink4:8,ib-ndr400"), 1, parse_strategy("ddp"))
    assert i is not None and i.dominant == NO_SWING
    table = plan(w, parse_topology("nvlink4:8,ib-ndr400"), [1], "ddp", intervals=True).table()
    assert "no range]" in table and "range from link efficiency" not in table


def test_the_wait_is_not_reported_when_the_cpu_cores_bound_sets_the_step():
    w = _cpu_workload()
    topo = Topology(Link("loopback", 1e-4, 1e9), 4)
    p = predict(w, topo, 3, parse_strategy("ddp"), PlanOptions(cpu_cores=2, bound="expected",
                                                               step_cv=0.2))
    assert p is not None and p.binding == "cpu cores (3 ranks on 2)"
    assert p.detail["straggler_s"] == 0.0


# ---- 10. --batch-size keeps the per-step overheads ----------------------------------------------

def test_with_batch_rescales_per_sample_phases_only():
    w = _cpu_workload().with_batch(16)
    assert (w.data, w.forward, w.backward) == pytest.approx((0.002, 0.020, 0.040))
    assert (w.optimizer, w.other) == (0.002, 0.004)


# ---- 17. what-if errors name CLI flags ----------------------------------------------------------

@pytest.mark.parametrize("argv, text", [
    (["--params", "1.3B"], "--step-time SECONDS"),
    (["--params", "1.3B", "--flops-per-sample", "1e12"], "--flops-per-sample needs --gpu-tflops"),
])
def test_a_what_if_without_compute_names_the_flags(argv, text, capsys):
    assert main(["plan", *argv, "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert text in err and "step_time" not in err and "gpu_flops" not in err


# ---- 16. the figures docs/plan.md quotes are the code's ----------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plan.md"
# The worked example's profile: the figures the page states for the demo's world-1 run.
DEMO = {"format": "lockstep-profile", "version": 1, "world_size": 1, "device": "cpu",
        "batch_size_per_rank": 16,
        "phases": {"data": 0.0065, "forward": 0.3434, "backward": 0.6599, "optimizer": 0.0179,
                   "exposed_comm": 0.0, "step": 1.0405},
        "model": {"trainable_parameters": 822144, "dtype": "float32", "buffer_broadcasts": []},
        "buckets": [{"bytes": 1010000.0, "ready": 0.198}, {"bytes": 2130000.0, "ready": 0.6599}]}


def test_the_worked_example_rows_are_what_the_command_prints(tmp_path, monkeypatch, capsys):
    text = DOCS.read_text()
    section = text[text.index("## Worked example"):text.index("## Validation")]
    block = section[section.index("```text\n") + 8:]
    rows = [line for line in block[:block.index("```")].splitlines()[1:] if line.strip()]
    assert len(rows) >= 5 and all("[eff " in r for r in rows)  # the ranges, not the line rate
    (tmp_path / "prof" / "world1").mkdir(parents=True)
    (tmp_path / "prof" / "world1" / "profile.json").write_text(json.dumps(DEMO))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "prof/world1/profile.json", "--gpus", "8,64,512,4096", "--link",
                 "eth10"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert all(row in printed for row in rows)


def test_the_horovod_line_rate_table_is_what_the_commands_print():
    text = DOCS.read_text()
    for model, params, step in (("Inception V3", 23.9e6, 0.4507), ("VGG-16", 138.4e6, 0.4156)):
        w = describe(params, step_time=step, batch_size=64, dtype="float32")
        result = plan(w, parse_topology("pcie3:4,roce25x1"), [128, 512], "ddp")
        for p in result.predictions:
            assert f"| {model} | {p.gpus} |" in text
            row = text[text.index(f"| {model} | {p.gpus} |"):].splitlines()[0]
            assert f"| {p.efficiency * 100:.1f}% |" in row, row
