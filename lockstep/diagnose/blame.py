"""What a rank can tell of its peers when a wait fails, and the verdict it leaves the launcher.

:func:`observe_peers` watches the peers' progress records (:mod:`lockstep.diagnose.progress`) for a few
heartbeats and says whether each is alive but stuck, exited, or gone; :func:`write_blame`
leaves the verdict beside torch elastic's error file, where ``lockstep run`` reads it
(:func:`read_blame`) to report the rank that stopped as the root cause. Both
:mod:`lockstep.diagnose.hang` (a collective that times out) and :mod:`lockstep.diagnose.abort_guard` (a rank
that gloo aborts) use them; this module imports neither, nor the tracker, so the tracker can
install the abort guard without an import circle (issue #27).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.diagnose.progress import ProgressTracker

__all__ = ["BLAME_FILE", "observe_peers", "read_blame", "write_blame"]

BLAME_FILE = "lockstep_blame.json"

# A peer that publishes nothing for this many intervals (and at least this long) is gone.
_SILENCE_INTERVALS = 3
_MIN_SILENCE_S = 2.0


def observe_peers(
    found: ProgressTracker, first: dict[int, dict[str, Any] | None]
) -> tuple[dict[int, str], dict[int, dict[str, Any] | None], float]:
    """Watch the peers' heartbeats until each has beaten or exited, or for a few intervals.

    A record published after ``first`` is fresh: a living peer's position then is the truth,
    even if its earlier record lagged. Returns each peer's state and latest record, and how
    long the silent ones were watched.
    """
    start = time.monotonic()
    deadline = start + max(_SILENCE_INTERVALS * found.interval, _MIN_SILENCE_S)
    latest = dict(first)
    states = {rank: _state(first[rank], rec) for rank, rec in latest.items()}
    while any(state in ("gone", "silent") for state in states.values()):
        if time.monotonic() >= deadline:
            break
        time.sleep(min(found.interval / 4, 0.25))
        latest = found.read(list(first))
        states = {rank: _state(first[rank], rec) for rank, rec in latest.items()}
    return states, latest, time.monotonic() - start


def _state(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    if after is None:
        return "silent"
    if after.get("state") in ("exited", "raised"):
        return str(after["state"])
    if before is not None and after.get("beat", 0) > before.get("beat", 0):
        return "stuck"
    return "gone"


# ---- the launcher's evidence ---------------------------------------------------------------
def write_blame(rank: int, culprits: list[dict[str, Any]], message: str) -> None:
    """Leave this rank's verdict beside torch elastic's error file (under ``lockstep run``).

    Args:
        rank: the rank writing (the one that waited).
        culprits: one dict per rank to blame: ``rank``, ``state`` and what is known of it.
        message: the error this rank raises.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    path = os.path.join(os.path.dirname(error_file), BLAME_FILE)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump({"rank": rank, "culprits": culprits, "message": message}, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher then falls back on exit codes and timestamps


def read_blame(error_file: str | None) -> dict[str, Any] | None:
    """The verdict a worker left beside its ``error_file``, or None."""
    if not error_file:
        return None
    path = os.path.join(os.path.dirname(error_file), BLAME_FILE)
    try:
        with open(path) as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("culprits") else None
