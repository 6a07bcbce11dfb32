"""Where the ranks of a save or restore meet, and what they must agree on.

The meeting goes through the rendezvous store, not a collective: a rank that never comes
leaves nothing pending in the process group, and the others learn who is missing. While
waiting, each rank shows which directory it is in, so that ranks given different directories
are told so at once instead of timing out.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.io import CheckpointError
from lockstep.diagnose import hang
from lockstep.diagnose.progress import default_store

__all__ = ["check_agreement", "meet"]

_IN_CALL = "lockstep/checkpoint/in-call"  # store key prefix: the directory each rank is in
_MEETING = "lockstep/checkpoint/meet"  # store key prefix: who arrived at which call
_POLL_S = 0.2  # at most this long between two looks at the store while waiting
# Ranks in another directory are looked for once the wait has lasted this long, then this
# often: ranks that meet usually come within milliseconds, and each look costs a request per
# rank that has not come.
_FIRST_LOOK_S = 0.05
_LOOK_EVERY_S = 1.0


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
    missing = [] if arrived >= len(ranks) else _wait(
        store, keys, counter, call, directory, timeout)
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
    """Poll until every rank arrived (returns []) or the timeout (returns the missing)."""
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    pause = 0.0005
    look_around = start + _FIRST_LOOK_S  # when to look for ranks in another directory
    while True:
        if store.add(counter, 0) >= len(keys):
            return []
        now = time.monotonic()
        if now > deadline:
            return [r for r, key in keys.items() if not store.check([key])]
        if now >= look_around:
            _refuse_other_directories(store, keys, call, directory)
            look_around = now + _LOOK_EVERY_S
        # Look again after `pause`, growing from 0.5 ms: the ranks usually arrive within a few
        # milliseconds of each other. (Not the store's own wait with a timeout: the store logs
        # a warning each time one expires, two lines on stderr per look.)
        time.sleep(pause)
        pause = min(pause * 1.5, _POLL_S)


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
