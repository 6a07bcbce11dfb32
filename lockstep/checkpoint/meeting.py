"""Where the ranks of a save or restore meet, and what they must agree on.

The meeting goes through the rendezvous store, not a collective: a rank that never comes
leaves nothing pending in the process group, and the others learn who is missing. While
waiting, each rank shows which directory it is in, so that ranks given different directories
are told so at once instead of timing out. A rank that will never come because its process
died is told apart from one that is only elsewhere (alive, e.g. a script that saves on rank 0
alone): the first ends the wait within about a second with :class:`PeerLostError`, a peer's
failure; the second is named after the timeout, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.io import CheckpointError
from lockstep.diagnose import hang
from lockstep.diagnose.progress import default_store, tracker
from lockstep.env import process_runs

__all__ = ["PeerLostError", "add_absence_probe", "check_agreement", "meet"]

# Which of the ranks a meeting waits for are dead: ``probe(ranks) -> {rank: why}`` (global
# ranks of the default group). The layers above that know it register one (lockstep.Survivors:
# the launcher's marks of the dead); the progress records are always consulted.
AbsenceProbe = Callable[[list[int]], dict[int, str]]
_PROBES: list[AbsenceProbe] = []

_IN_CALL = "lockstep/checkpoint/in-call"  # store key prefix: the directory each rank is in
_MEETING = "lockstep/checkpoint/meet"  # store key prefix: who arrived at which call
_POLL_S = 0.2  # at most this long between two looks at the store while waiting
# Ranks in another directory are looked for once the wait has lasted this long, then this
# often: ranks that meet usually come within milliseconds, and each look costs a request per
# rank that has not come.
_FIRST_LOOK_S = 0.05
_LOOK_EVERY_S = 1.0
# Ranks that have not come are checked for death this long into the wait, then this often.
_FIRST_DEATH_CHECK_S = 0.5
_DEATH_CHECK_EVERY_S = 1.0
# A peer on another host whose progress record stood still this long (and this many
# publication intervals) is counted dead; on this host its process is looked up instead.
_SILENCE_S = 10.0
_SILENCE_INTERVALS = 10


class PeerLostError(CheckpointError, dist.DistNetworkError):
    """A rank that a save or restore waited for is dead: a failure of a peer, not of the
    checkpoint. A ``CheckpointError`` and, as a collective's error would be, a
    ``torch.distributed.DistNetworkError`` (so ``lockstep.Survivors`` recovers from it).

    Attributes:
        dead: each dead rank and why it is counted dead.
    """

    def __init__(self, message: str, dead: dict[int, str]) -> None:
        super().__init__(message)
        self.dead = dead


def add_absence_probe(probe: AbsenceProbe) -> Callable[[], None]:
    """Let ``probe`` tell which ranks that have not come to a meeting are dead.

    ``probe(ranks)`` gets the global ranks still awaited and returns ``{rank: why}`` for those it
    knows dead (``why`` completes "rank 2 ...", e.g. ``"died: a launcher marked it dead"``);
    it is called on the waiting thread, about once a second. Returns the function that removes
    it again.
    """
    _PROBES.append(probe)

    def remove() -> None:
        if probe in _PROBES:
            _PROBES.remove(probe)

    return remove


def meet(
    directory: Path, call: str, number: int, timeout: timedelta, process_group: Any = None
) -> None:
    """Wait for every rank of ``process_group`` at call ``number`` on ``directory``.

    Raises:
        CheckpointError: a rank did not come within ``timeout`` (named), or the ranks are in
            different directories (each named with its directory).
    """
    store = default_store()
    if store is None:
        return  # no store to meet in: the collectives that follow are the barrier
    # The path as given, not resolved: machines may mount a shared filesystem differently.
    where = hashlib.sha1(str(directory).encode()).hexdigest()[:12]
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    keys = {r: f"{_MEETING}/{where}/{number}/{r}" for r in ranks}
    # One counter per meeting: a rank learns that all have come in one request, however many
    # ranks there are (looking at each rank's key would cost the store ranks² requests).
    group = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    counter = f"{_MEETING}/{where}/{number}/count/{group}"
    me = dist.get_rank()
    store.set(f"{_IN_CALL}/{me}", str(directory))
    store.set(keys[me], "1")  # who came, for naming the others if they do not
    arrived = store.add(counter, 1)
    start = time.monotonic()
    try:
        missing = [] if arrived >= len(ranks) else _wait(
            store, keys, counter, call, directory, timeout)
    except PeerLostError as lost:
        store.set(f"{_IN_CALL}/{me}", "")
        listed = "; ".join(f"rank {r} {why}" for r, why in sorted(lost.dead.items()))
        raise PeerLostError(
            f"rank {me} waited {time.monotonic() - start:.1f}s in Checkpointer.{call} for "
            f"rank(s) {sorted(lost.dead)}, which will never call it: {listed}. A peer's "
            "failure, not this checkpoint's (under lockstep run --survivors the others go on "
            "without it; otherwise resume from the previous checkpoint).", lost.dead) from None
    store.set(f"{_IN_CALL}/{me}", "")
    if missing:
        raise CheckpointError(hang.describe_missing(missing, (
            f"rank {me} waited {timeout.total_seconds():g}s in "
            f"Checkpointer.{call} for rank(s) {missing}, which never called it. Call save() "
            "and restore() on every rank, not only on rank 0."
        ), meeting=f"Checkpointer.{call}"))


def _wait(
    store: Any, keys: dict[int, str], counter: str, call: str, directory: Path,
    timeout: timedelta,
) -> list[int]:
    """Poll until every rank arrived (returns []) or the timeout (returns the missing).

    Raises:
        PeerLostError: a rank that has not come is dead (its message is the caller's).
    """
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    pause = 0.0005
    look_around = start + _FIRST_LOOK_S  # when to look for ranks in another directory
    check_deaths = start + _FIRST_DEATH_CHECK_S
    records = _Silence()
    while True:
        if store.add(counter, 0) >= len(keys):
            return []
        now = time.monotonic()
        if now > deadline:
            return [r for r, key in keys.items() if not store.check([key])]
        if now >= look_around:
            _refuse_other_directories(store, keys, call, directory)
            look_around = now + _LOOK_EVERY_S
        if now >= check_deaths:
            dead = _dead_among([r for r, key in keys.items() if not store.check([key])], records)
            if dead:
                # A rank that left because it saw this one in another directory: say that.
                _refuse_other_directories(store, keys, call, directory)
                raise PeerLostError("", dead)
            check_deaths = now + _DEATH_CHECK_EVERY_S
        # Look again after `pause`, growing from 0.5 ms: the ranks usually arrive within a few
        # milliseconds of each other. (Not the store's own wait with a timeout: the store logs
        # a warning each time one expires, two lines on stderr per look.)
        time.sleep(pause)
        pause = min(pause * 1.5, _POLL_S)


def _dead_among(missing: list[int], records: _Silence) -> dict[int, str]:
    """Which of ``missing`` are dead, by the registered probes and the progress records."""
    dead: dict[int, str] = {}
    for probe in _PROBES:
        # A probe that cannot tell (its store went away): the timeout decides, as before.
        with contextlib.suppress(Exception):
            dead.update(probe(missing))
    found = tracker()
    if found is None or not missing:
        return dead
    try:
        latest = found.read(missing)
    except Exception:  # noqa: BLE001 - the store's host may be gone: the timeout decides
        return dead
    for rank, record in latest.items():
        why = records.dead(rank, record, found.interval)
        if why and rank not in dead:
            dead[rank] = why
    return dead


class _Silence:
    """What the progress records say of the ranks a meeting waits for: exited, failed, a
    process gone from this host, or silent too long on another."""

    def __init__(self) -> None:
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (beat, when it was first seen)

    def dead(self, rank: int, record: dict[str, Any] | None, interval: float) -> str | None:
        if record is None:
            return None  # never published: not started yet, or not publishing at all
        if record.get("state") in ("exited", "raised"):
            error = f" ({record['error']})" if record.get("error") else ""
            return (f"exited without calling it{error}" if record["state"] == "exited" else
                    f"failed with an error of its own{error}")
        pid = record.get("pid")
        if record.get("host") == socket.gethostname() and isinstance(pid, int):
            return None if process_runs(pid) else f"died (pid {pid} on this host is gone)"
        now, beat = time.monotonic(), int(record.get("beat", 0))
        last = self._beats.get(rank)
        if last is None or last[0] != beat:
            self._beats[rank] = (beat, now)
            return None
        silent = now - last[1]
        if silent >= max(_SILENCE_S, _SILENCE_INTERVALS * interval):
            return (f"is gone: no sign of life for {silent:.0f}s (its process died or its "
                    "machine was lost)")
        return None


def _refuse_other_directories(
    store: Any, keys: dict[int, str], call: str, directory: Path
) -> None:
    """Raise if a rank that has not come is in a call on another directory."""
    elsewhere = {}
    for rank, key in keys.items():
        if not store.check([key]) and store.check([f"{_IN_CALL}/{rank}"]):
            elsewhere[rank] = store.get(f"{_IN_CALL}/{rank}").decode()
    elsewhere = {r: d for r, d in elsewhere.items() if d and d != str(directory)}
    if elsewhere:
        mine = {dist.get_rank(): str(directory)}
        listed = ", ".join(f"rank {r}: {d!r}" for r, d in sorted({**mine, **elsewhere}.items()))
        # The in-call mark stays: the other ranks see this one's directory too.
        raise CheckpointError(
            f"Checkpointer.{call}: the ranks use different directories ({listed}). Every "
            "rank must pass the same directory (one shared by all of them)."
        )


def check_agreement(call: str, seen: list[tuple[str, int | None]],
                    names: list[list[str]] | None = None) -> None:
    """Raise if the ranks' ``(directory, step)`` differ, or the names of the objects they
    passed (``names``, a save's); both are indexed by rank.

    Raises:
        CheckpointError: naming each rank's directory, step or objects.
    """
    directories = {rank: where for rank, (where, _) in enumerate(seen)}
    if len(set(directories.values())) > 1:
        listed = ", ".join(f"rank {r}: {d!r}" for r, d in directories.items())
        raise CheckpointError(
            f"Checkpointer.{call}: the ranks use different directories ({listed}). Every "
            "rank must pass the same directory (one shared by all of them)."
        )
    steps = {rank: s for rank, (_, s) in enumerate(seen)}
    if len(set(steps.values())) > 1:
        listed = ", ".join(f"rank {r}: {s}" for r, s in steps.items())
        raise CheckpointError(
            f"Checkpointer.{call}: the ranks passed different steps ({listed}). Pass the "
            "same step on every rank (e.g. the global step, not a per-rank counter)."
        )
    if names is not None and any(given != names[0] for given in names):
        listed = ", ".join(f"rank {r}: {given}" for r, given in enumerate(names))
        raise CheckpointError(
            f"Checkpointer.{call}: the ranks passed different objects ({listed}). Pass the "
            "same names on every rank (rank 0's alone would be written, the others' lost)."
        )
