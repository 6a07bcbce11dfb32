"""The demo (examples/train_gpt.py): a short run on one and on two workers, and their equivalence.

Two workers run under ``lockstep run``, as the README does.

With the same global batch, two workers of batch 4 see exactly the samples one worker of batch 8
sees each step (the sampler hands rank r every other position of the same permutation), so
their loss curves must agree up to float rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Building the first optimizer imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; import it
# before conftest's environment-leak check takes its snapshot.
import torch._dynamo

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = [
    "--max-steps", "20", "--eval-interval", "10", "--log-interval", "5", "--n-layer", "1",
    "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--eval-blocks", "15",
    "--max-files", "20", "--lr", "1e-2", "--warmup-steps", "2", "--sample-chars", "20",
]
CPU = ["--device", "cpu"]


def _check_outputs(out_dir: Path, world_size: int, device: str = "cpu") -> dict:
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["world_size"] == world_size and metrics["steps"] == 20
    assert metrics["device"].startswith(device)
    assert metrics["tokens_seen"] == 20 * 8 * 32 and metrics["tokens_per_s"] > 0
    assert [step for step, _ in metrics["val_loss"]] == [0, 10, 20]
    # Loss falls clearly even in 20 steps of a tiny model: from ln(97) = 4.57 to well below 4.
    assert metrics["initial_val_loss"] > 4.4
    assert metrics["final_val_loss"] < metrics["initial_val_loss"] - 0.6
    assert metrics["final_train_loss"] < metrics["first_step_train_loss"] - 0.6
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return metrics


@pytest.mark.multirank
def test_demo_on_one_and_two_workers_agree(tmp_path, monkeypatch, capsys):
    # One worker, in this process (plain `python examples/train_gpt.py`): a world of one.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_gpt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_gpt.main([*TINY, *CPU, "--batch-size", "8", "--out-dir", str(tmp_path / "one")])
    finally:
        torch.set_num_threads(threads)
    assert "world size 1 on cpu" in capsys.readouterr().out
    single = _check_outputs(tmp_path / "one", world_size=1)

    # Two workers under the README's launcher, batch 4 each: the same global batch.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2",
        str(EXAMPLES / "train_gpt.py"), *TINY, *CPU, "--batch-size", "4", "--out-dir", str(tmp_path / "two"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "world size 2 on cpu" in output and "tokens/s" in output
    assert "training on 2 worker(s)" in output  # rank 0's progress bar
    double = _check_outputs(tmp_path / "two", world_size=2)

    for key in ("val_loss", "train_loss"):
        steps = [s for s, _ in single[key]]
        assert steps == [s for s, _ in double[key]]
        for (_, a), (_, b) in zip(single[key], double[key]):
            assert a == pytest.approx(b, abs=5e-4), key  # measured: within 1e-4


@pytest.mark.gpu
@pytest.mark.multirank
def test_demo_on_one_gpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_gpt

    # --device cuda: conftest sets LOCKSTEP_DEVICE=cpu for the suite, which the demo's default obeys.
    train_gpt.main([*TINY, "--device", "cuda", "--batch-size", "8", "--out-dir", str(tmp_path)])
    _check_outputs(tmp_path, world_size=1, device="cuda")


def test_corpus_split_is_deterministic_and_errors_name_the_directory(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from chargpt import Vocab, load_corpus

    corpus = load_corpus(max_files=30)
    assert len(corpus.train_files) == 27 and len(corpus.val_files) == 3
    assert corpus.val_files == sorted(corpus.root.glob("*.py"))[9:30:10]  # every tenth file
    assert load_corpus(max_files=30).train_files == corpus.train_files
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    vocab = Vocab()
    assert vocab.decode(vocab.encode("def f(x):\n\treturn x  # é")) == "def f(x):\n\treturn x  # ?"

    (tmp_path / "only.py").write_text("pass\n")
    with pytest.raises(RuntimeError, match=rf"{tmp_path} holds 1 .py files, the demo needs at least 10"):
        load_corpus(root=tmp_path)
    for i in range(11):
        (tmp_path / f"m{i}.py").write_text("pass\n")
    with pytest.raises(RuntimeError, match=rf"--max-files 5 keeps 5 of the 12 .py files in {tmp_path}"):
        load_corpus(max_files=5, root=tmp_path)


@pytest.mark.parametrize("flags,message", [
    (["--warmup-steps", "-1"], "--warmup-steps must be at least 0, got -1"),
    (["--n-embd", "30", "--n-head", "4"], "--n-embd 30 must be a multiple of --n-head 4"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--max-files", "-1"], "--max-files must be at least 1, got -1"),
])
def test_demo_flags_that_cannot_work_are_refused_up_front(monkeypatch, capsys, flags, message):
    # Until 2026-11-29 these were accepted: ignored, a traceback from every rank, or a file dropped.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_gpt

    with pytest.raises(SystemExit):
        train_gpt.parse_args(flags)
    assert message in capsys.readouterr().err


def test_demo_with_fewer_sequences_than_a_batch_says_so_instead_of_spinning(tmp_path, monkeypatch):
    # Every batch dropped (drop_last): the endless batch loop waited forever until 2026-11-29.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_gpt

    args = [*TINY, *CPU, "--batch-size", "100000", "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="fewer than --batch-size 100000: lower --batch-size"):
        train_gpt.main(args)


def test_demo_resumes_from_its_checkpoint_bitwise(tmp_path, monkeypatch, capsys):
    """A run resumed from the demo's step-10 checkpoint ends with the uninterrupted run's state."""
    import shutil

    from lockstep.checkpoint.io import read_verified

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_gpt

    def run(name: str, *extra: str) -> None:
        train_gpt.main([*TINY, *CPU, "--batch-size", "8", "--sample-chars", "0", "--out-dir",
                        str(tmp_path / name), "--checkpoint-dir", str(tmp_path / name / "ckpt"),
                        "--checkpoint-every", "10", *extra])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run("whole")
        (tmp_path / "resumed" / "ckpt").mkdir(parents=True)
        shutil.copytree(tmp_path / "whole" / "ckpt" / "step_000000000010",
                        tmp_path / "resumed" / "ckpt" / "step_000000000010")
        # Saves paced to 5% of the time in between: the last step's is never skipped.
        run("resumed", "--checkpoint-every", "1", "--checkpoint-max-overhead", "0.05")
        assert "resumed from" in capsys.readouterr().out
        # The same command after the run finished: nothing to train, and a normal return (it
        # exited 1 until 2026-11-29, so a launcher's --max-restarts started it over and over).
        (tmp_path / "whole" / "metrics.json").unlink()
        run("whole")
        assert "already holds step 20 of --max-steps 20: nothing to train" in capsys.readouterr().out
        assert not (tmp_path / "whole" / "metrics.json").exists()
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "resumed" / "metrics.json").read_text())["resumed_at_step"] == 10
    whole, resumed = (tmp_path / name / "ckpt" / "step_000000000020" for name in ("whole", "resumed"))
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in resumed.iterdir()) and "state.pt" in names

    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    for name in names:
        assert equal(read_verified(whole / name), read_verified(resumed / name)), name
