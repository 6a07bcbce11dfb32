"""DDP options given differently per rank: one clear error on every rank, not a hang or SIGABRT.

Until 2026-11-29 ``find_unused_parameters`` on one rank hung both for the process group's
timeout, ``static_graph`` on one rank aborted gloo (SIGABRT), and ``bucket_cap_mb`` /
``broadcast_buffers`` per rank were blamed on a rank that skipped a collective or built another
model. The multi-rank cases share one world of two. (A comm hook registered on one rank only is
not compared: that would take a collective at registration or an extra one per model.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.ddp.replica_sync import ReplicaMismatchError, option_mismatch
from lockstep.diagnose.abort_guard import AbortGuard


def test_option_mismatch_names_the_option_and_each_ranks_value():
    assert option_mismatch([{"static_graph": False}, {"static_graph": False}]) is None
    message = option_mismatch([{"bucket_cap_mb": 25.0, "static_graph": True},
                               {"bucket_cap_mb": 25.0, "static_graph": False},
                               {"bucket_cap_mb": 25.0, "static_graph": True}])
    assert message is not None
    assert ("DistributedDataParallel: static_graph differs across ranks (rank 0: True, rank 1: "
            "False, rank 2: True); rank(s) [1] differ from rank 0") in message
    assert "pass the same value on every rank" in message


class _TwoRanks:
    """A progress tracker's reading side for rank 0 of two, at fixed counts."""

    def __init__(self, mine: int, theirs: int) -> None:
        self.rank, self.counts, self.interval, self.beat, self._theirs = 0, {"0-1": mine}, 0.01, 0, theirs

    def publish_now(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"rank": 0, "step": 1, "last_op": "DDP", "counts": self.counts}

    def read(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        self.beat += 1
        return {r: {"rank": r, "counts": {"0-1": self._theirs}, "beat": self.beat,
                    "state": "running", "step": 1, "last_op": "DDP"} for r in ranks}


def test_abort_verdict_does_not_assert_a_skipped_collective(tmp_path, monkeypatch):
    # bucket_cap_mb per rank: rank 0 ran 4 all-reduces, rank 1 ran 5; nobody skipped one.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    message = AbortGuard(_TwoRanks(4, 5)).verdict()
    assert message is not None and "rank 0 entered 4" in message
    assert "skipped a collective (or ran an extra one)" not in message
    assert "ran a different sequence of collectives than the others" in message
    assert "bucket_cap_mb" in message and "a comm hook registered on some ranks only" in message


def _model(buffers: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if buffers:
        return nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = _model(), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _attempt(rank: int, case: str) -> str:
    """One case: the error's message, or the gradients' sum after two steps."""
    model: nn.Module = _model(buffers=case == "broadcast_buffers")
    kwargs: dict[str, Any] = {
        "find_unused_parameters": {"find_unused_parameters": rank == 0},
        "static_graph": {"static_graph": rank == 1},
        "bucket_cap_mb": {"bucket_cap_mb": 25 if rank == 0 else 0.0001},
        "broadcast_buffers": {"broadcast_buffers": rank == 0},
        "gradient_as_bucket_view": {"gradient_as_bucket_view": rank == 0},  # harmless per rank
    }.get(case, {})
    if case == "find_unused_parameters":
        model = _WithUnused()
    try:
        ddp = lockstep.DistributedDataParallel(model, **kwargs)
        for step in range(2):
            ddp.zero_grad()
            ddp(torch.full((4, 6), float(rank + step))).sum().backward()
    except ReplicaMismatchError as exc:
        return str(exc)
    return f"ok {sum(float(p.grad.sum()) for p in ddp.parameters()):.5f}"


def _cases(rank: int) -> dict[str, str]:
    lockstep.init_distributed()
    cases = ["find_unused_parameters", "static_graph", "bucket_cap_mb", "broadcast_buffers",
             "gradient_as_bucket_view"]
    return {case: _attempt(rank, case) for case in cases}


def test_options_that_differ_per_rank_are_named_on_every_rank():
    results = lockstep.spawn(_cases, 2, timeout=120)
    assert results[0] == results[1], results  # the same message on every rank
    found = results[0]
    expected = {
        "find_unused_parameters": "find_unused_parameters differs across ranks (rank 0: True, rank 1: False)",
        "static_graph": "static_graph differs across ranks (rank 0: False, rank 1: True)",
        "bucket_cap_mb": "bucket_cap_mb differs across ranks (rank 0: 25.0, rank 1: 0.0001)",
        "broadcast_buffers": "broadcast_buffers differs across ranks (rank 0: True, rank 1: False)",
    }
    for case, text in expected.items():
        assert found[case].startswith(f"DistributedDataParallel: {text}; rank(s) [1] differ"), (case, found[case])
    assert found["gradient_as_bucket_view"].startswith("ok "), found
