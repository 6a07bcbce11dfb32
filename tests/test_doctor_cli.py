"""`lockstep doctor` end to end on the demo: both runs, the table, the files.

Two launches (1 and 2 workers) of examples/train_gpt.py with a tiny model, stopped by the doctor
after a few steps: the slowest test of the doctor (the launcher's start-up dominates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Building the first optimizer imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; import it
# before conftest's environment-leak check takes its snapshot.
import torch._dynamo  # noqa: F401

from lockstep.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--max-steps", "30", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size",
    "32", "--eval-interval", "100", "--eval-blocks", "8", "--max-files", "10",
    "--sample-chars", "0", "--device", "cpu",
]


def test_doctor_parser_takes_the_script_and_its_arguments():
    args = build_parser().parse_args(["doctor", "--nproc-per-node", "3", "train.py", "--lr", "1"])
    assert (args.nproc_per_node, args.training_script, args.training_script_args) == (
        3, "train.py", ["--lr", "1"])
    assert args.steps == 40 and args.warmup == 5


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_doctor_on_the_demo(tmp_path):
    out = tmp_path / "doctor"
    cmd = [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", "12",
           "--warmup", "3", "--out-dir", str(out), str(ROOT / "examples" / "train_gpt.py"),
           *TINY, "--out-dir", str(tmp_path / "demo")]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=220, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "ideal 2.00x -> measured" in text and "= measured speedup" in text
    assert "unexplained" in text and "what to try first:" in text
    assert "bucket" in text and "busbw" in text
    profile = json.loads((out / "profile.json").read_text())
    assert profile["format"] == "lockstep-profile" and profile["world_size"] == 2
    assert 12 - 3 >= profile["steps"] > 0 and profile["batch_size_per_rank"] == 16
    assert profile["account"]["ideal"] == 2.0 and profile["buckets"]
    assert json.loads((out / "world1" / "profile.json").read_text())["world_size"] == 1
    trace = json.loads((out / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer", "all-reduce bucket 0"} <= names
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["account"]["measured"] > 0


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_doctor_without_matplotlib_keeps_the_report(tmp_path):
    """matplotlib is optional (issue 25): without it the account, profile.json, summary.json and
    trace.json are still written, and timeline.png is skipped with one line."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    out = tmp_path / "doctor"
    cmd = [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", "8",
           "--warmup", "2", "--out-dir", str(out), str(ROOT / "examples" / "train_gpt.py"),
           *TINY, "--out-dir", str(tmp_path / "demo")]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=220, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ideal 2.00x -> measured" in done.stdout
    assert (f"skipped {out / 'timeline.png'}: matplotlib is not installed "
            "(pip install matplotlib)") in done.stdout
    for name in ("profile.json", "summary.json", "trace.json"):
        assert json.loads((out / name).read_text())
    assert not (out / "timeline.png").exists()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_doctor_on_a_script_that_ends_before_its_step_count(tmp_path):
    """docs/doctor.md's first command (issue 25): the script's --max-steps ends it before the
    doctor's --steps and it destroys its process group; every rank's profile is still written."""
    out = tmp_path / "doctor"
    cmd = [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--warmup", "3",
           "--out-dir", str(out), str(ROOT / "examples" / "train_gpt.py"), *TINY[2:],
           "--max-steps", "10", "--out-dir", str(tmp_path / "demo")]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=220, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ideal 2.00x -> measured" in done.stdout
    assert {p.name for p in (out / "world2").glob("rank*.json")} == {"rank0.json", "rank1.json"}
    assert json.loads((out / "profile.json").read_text())["world_size"] == 2


def test_doctor_names_a_missing_script_and_an_out_dir_it_cannot_make(tmp_path, capsys):
    from lockstep.cli import main

    common = ["doctor", "--nproc-per-node", "2", "--steps", "4", "--warmup", "1"]
    assert main([*common, "--out-dir", str(tmp_path / "o"), str(tmp_path / "nope.py")]) == 2
    assert "training script" in capsys.readouterr().err
    script, taken = tmp_path / "train.py", tmp_path / "a-file"
    script.write_text("print('never run')\n")
    taken.write_text("")
    assert main([*common, "--out-dir", str(taken), str(script)]) == 2
    assert f"cannot write into --out-dir {taken}" in capsys.readouterr().err


@pytest.mark.multirank
def test_a_failed_run_leaves_no_earlier_profile_that_passes_for_its_own(tmp_path):
    """An earlier run's profile.json (per world and the report) is removed before the runs: a
    script that now fails leaves nothing that `lockstep plan` would take for this one."""
    out = tmp_path / "doc"
    for stale in (out / "world1" / "profile.json", out / "world2" / "profile.json",
                  out / "profile.json", out / "summary.json"):
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text('{"from": "an earlier script"}')
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    cmd = [sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2", "--steps", "4",
           "--warmup", "1", "--out-dir", str(out), str(script)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=220,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, done.stderr[-3000:]
    assert sorted(p.name for p in out.rglob("*.json")) == [], done.stderr[-3000:]


_NO_GROUP = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_doctor_refuses_a_run_whose_workers_never_met(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(_NO_GROUP)
    done = subprocess.run([sys.executable, "-m", "lockstep", "doctor", "--nproc-per-node", "2",
                           "--steps", "6", "--warmup", "2", "--out-dir", str(tmp_path / "o"),
                           str(script)], check=False, capture_output=True, text=True, timeout=220,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the 2-worker run recorded a world of 1" in done.stderr


_SAVER = """
import sys
from lockstep.doctor.rank_file import RankFile
steps = [0]
f = RankFile(sys.argv[1], 0, lambda: {"steps": steps[0]}, lambda: steps[0])
for i in range(1500):
    steps[0] = i
    f.save()
"""


def test_workers_that_are_each_rank_0_write_the_same_rank_file_without_failing(tmp_path):
    # Workers that never met a process group are each rank 0 of their own world and save
    # rank0.json at once; a shared temporary name made one's rename fail (seen in the slow
    # tier's test above under load): the doctor said "the run failed" instead of naming why.
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "o")], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["rank0.json"]


def test_doctor_usage_errors_are_the_doctors(capsys):
    """Until 2026-11-29 an unknown doctor flag printed `lockstep`'s usage, and a missing script
    said the (optional) script arguments were required too."""
    from lockstep.cli import main

    with pytest.raises(SystemExit) as bad:
        main(["doctor", "--bogus", "train.py"])
    err = capsys.readouterr().err
    assert bad.value.code == 2
    assert "usage: lockstep doctor" in err and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["doctor", "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert "required: training_script" in err and "training_script_args" not in err


def test_the_format_page_says_torch_ddp_all_reduces_at_world_1():
    """A world-1 torch DDP profile has all-reduce times (its observer launches each bucket's
    all-reduce); until 2026-11-29 the format page said the field was 0 at world 1."""
    text = (ROOT / "docs" / "profile-format.md").read_text()
    assert "(0 at world 1)" not in text
    assert "torch's own\nDDP still all-reduces every bucket over its group of one" in text
