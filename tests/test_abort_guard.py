"""Tests of lockstep.diagnose.abort_guard: the verdict a rank that gloo aborted leaves, from the counts.

Pure logic on recorded progress records (the multi-process case, a rank skipping a DDP backward
under ``lockstep run``, is in tests/test_hangs.py: the root cause must be the rank that skipped,
not the one gloo aborted).
"""

from __future__ import annotations

import json
from typing import Any

from lockstep.diagnose.abort_guard import AbortGuard, odd_counts
from lockstep.diagnose.hang import BLAME_FILE


def test_odd_counts_names_the_rank_off_the_majority_or_behind():
    assert odd_counts({"0-1": {0: 4, 1: 4}}) is None
    assert odd_counts({"0-1-2": {0: 4, 1: 4, 2: 3}}) == ("0-1-2", [2], 4)
    assert odd_counts({"0-1-2": {0: 5, 1: 4, 2: 4}}) == ("0-1-2", [0], 4)  # one extra: still odd
    assert odd_counts({"0-1": {0: 4, 1: 3}}) == ("0-1", [1], 4)  # two ranks: the one behind
    assert odd_counts({"0-1": {0: 2, 1: 2}, "1-2": {1: 1, 2: 0}}) == ("1-2", [2], 1)


class _Tracker:
    """A ProgressTracker's reading side: peers that beat at every read, at fixed counts."""

    def __init__(self, rank: int, counts: dict[str, int], peers: dict[int, dict[str, int]]) -> None:
        self.rank, self.counts, self.peers, self.interval, self.beat = rank, counts, peers, 0.01, 0
        self.published = 0

    def publish_now(self) -> None:
        self.published += 1

    def snapshot(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": 3, "phase": "backward", "last_op": "DDP", "counts": self.counts}

    def read(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        self.beat += 1
        return {r: {"rank": r, "counts": self.peers[r], "beat": self.beat, "state": "running",
                    "step": 3, "phase": "after forward, before backward", "last_op": "DDP", "pid": 7,
                    "host": "h", "local_rank": r} for r in ranks}


def test_verdict_names_the_rank_behind_and_leaves_blame_for_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    found = _Tracker(0, {"0-1-2": 4}, {1: {"0-1-2": 4}, 2: {"0-1-2": 3}})
    message = AbortGuard(found).verdict()
    assert found.published == 1  # its own live record first
    assert message is not None and message.startswith("rank 0: gloo aborted this process")
    assert "rank 2 entered 3 (last: DDP, step 3), where the others entered 4. Rank(s) [2]" in message
    blame = json.loads((tmp_path / BLAME_FILE).read_text())
    assert blame["rank"] == 0 and blame["message"] == message
    assert blame["culprits"] == [{"rank": 2, "state": "skipped", "count": 3, "expected": 4, "host": "h",
                                  "pid": 7, "local_rank": 2, "step": 3,
                                  "phase": "after forward, before backward", "last_op": "DDP"}]


def test_no_verdict_when_the_counts_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert AbortGuard(_Tracker(1, {"0-1": 5}, {0: {"0-1": 5}})).verdict() is None
    assert not (tmp_path / BLAME_FILE).exists()  # an abort of another kind ends as before


def test_no_verdict_when_the_rank_behind_is_still_moving(tmp_path, monkeypatch):
    # An abort of another kind while a peer was merely behind: its count grows as it is watched.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    found = _Tracker(0, {"0-1": 50}, {1: {"0-1": 3}})
    reads = found.read

    def moving(ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        out = reads(ranks)
        found.peers[1] = {"0-1": found.peers[1]["0-1"] + 1}
        return out

    found.read = moving  # type: ignore[method-assign]
    assert AbortGuard(found).verdict() is None
    assert not (tmp_path / BLAME_FILE).exists()
