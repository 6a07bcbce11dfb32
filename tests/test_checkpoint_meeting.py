"""The checkpoint meeting's wait, on a fake store: requests per look do not grow with the ranks.

Before, each look asked the store about every rank's key, so a save at N ranks cost the store N²
requests per look; an arrival counter answers in one. (The meeting itself, with real ranks, is
tested in test_checkpoint.py and test_reliability.py.)
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from lockstep.checkpoint import meeting
from lockstep.checkpoint.io import CheckpointError


class FakeStore:
    """A store whose counter grows by ``step`` at each look: ranks arriving over time."""

    def __init__(self, ranks: int, step: int) -> None:
        self.data: dict[str, bytes] = {}
        self.ranks, self.step = ranks, step
        self.requests: Counter[str] = Counter()

    def add(self, key: str, amount: int) -> int:
        self.requests["add"] += 1
        value = int(self.data.get(key, b"0")) + (amount or self.step)
        value = min(value, self.ranks)
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self.requests["check"] += 1
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self.requests["get"] += 1
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self.requests["set"] += 1
        self.data[key] = value.encode()


def _keys(ranks: int) -> dict[int, str]:
    return {r: f"meet/abc/1/{r}" for r in range(ranks)}


def test_each_look_is_one_request_however_many_ranks(monkeypatch):
    monkeypatch.setattr(meeting, "_FIRST_LOOK_S", 60.0)  # no look for other directories here
    store = FakeStore(ranks=1024, step=128)
    missing = meeting._wait(store, _keys(1024), "meet/abc/1/count/g", "save(step=1)",
                            Path("/ck"), timedelta(seconds=30))
    assert missing == []
    assert sum(store.requests.values()) == store.requests["add"] == 8  # 1024 / 128 looks


def test_a_rank_in_another_directory_is_named(monkeypatch):
    monkeypatch.setattr(meeting, "_FIRST_LOOK_S", 0.0)
    monkeypatch.setattr(meeting.dist, "get_rank", lambda: 0)
    store = FakeStore(ranks=2, step=0)  # rank 1 never comes to this meeting
    store.set("meet/abc/1/0", "1")
    store.set(f"{meeting._IN_CALL}/1", "/elsewhere")
    with pytest.raises(CheckpointError, match=r"different directories \(rank 0: '/ck', "
                                              r"rank 1: '/elsewhere'\)"):
        meeting._wait(store, _keys(2), "meet/abc/1/count/g", "save(step=1)", Path("/ck"),
                      timedelta(seconds=30))


def test_the_timeout_names_the_ranks_that_never_came(monkeypatch):
    monkeypatch.setattr(meeting, "_POLL_S", 0.001)
    store = FakeStore(ranks=4, step=0)
    for rank in (0, 2):
        store.set(f"meet/abc/1/{rank}", "1")
    missing = meeting._wait(store, _keys(4), "meet/abc/1/count/g", "save(step=1)",
                            Path("/ck"), timedelta(seconds=0.2))
    assert missing == [1, 3]


def test_a_rank_that_left_over_another_directory_is_named_for_it_not_as_lost(monkeypatch):
    """Rank 1 saw rank 0 in another directory, raised and exited: rank 0's check for the dead
    finds it gone before its next look. It must still say "different directories"."""
    monkeypatch.setattr(meeting, "_FIRST_LOOK_S", 60.0)  # the death check comes first
    monkeypatch.setattr(meeting, "_FIRST_DEATH_CHECK_S", 0.0)
    monkeypatch.setattr(meeting.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(meeting, "_dead_among", lambda missing, records: {1: "exited"})
    store = FakeStore(ranks=2, step=0)
    store.set("meet/abc/1/0", "1")
    store.set(f"{meeting._IN_CALL}/1", "/elsewhere")  # its mark stays after its error
    with pytest.raises(CheckpointError, match="different directories"):
        meeting._wait(store, _keys(2), "meet/abc/1/count/g", "restore()", Path("/ck"),
                      timedelta(seconds=30))
