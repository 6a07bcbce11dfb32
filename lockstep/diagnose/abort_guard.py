"""A rank that gloo aborts for a collective mismatch names the rank that skipped one, and exits 1.

When one rank skips a collective its peers run (a batch skipped on one rank, a branch taken on
one rank), its next collective meets theirs. If the message that arrives is larger than the
buffer waiting for it, gloo's transport thread throws ``EnforceNotMet`` ("Received data size
doesn't match expected size") where nothing catches it, and the process dies of SIGABRT. Often
the rank that dies is the victim, and the launcher named it as the root cause.

The counts of collectives every rank publishes (:mod:`lockstep.diagnose.progress`) tell who is behind,
but only once they are fresh: they are published about once a second, and the abort comes
within milliseconds. So :class:`AbortGuard` catches SIGABRT (a C handler installed through
ctypes: Python's own ``signal`` handlers run only between bytecodes of the main thread, which
never comes), publishes this rank's record, watches its peers' next heartbeats (they are alive,
blocked in the collective, and publish their live counts), and when their counts on a group
differ names the odd rank, leaves the blame file the launcher reads (:mod:`lockstep.diagnose.blame`),
prints the error and exits with status 1. An abort with no such evidence is left alone: the
handler returns and ``abort()`` ends the process as before.

Debug mode (``LOCKSTEP_DEBUG_COLLECTIVES=1``) catches the same mistake before the collective;
this costs nothing until the abort.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections import Counter
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from lockstep.diagnose.blame import observe_peers, write_blame

__all__ = ["AbortGuard", "CollectiveMismatchAbort", "odd_counts"]

logger = logging.getLogger(__name__)

# Reading the peers takes a few heartbeats (lockstep.diagnose.blame.observe_peers); past this, give up.
_VERDICT_DEADLINE_S = 30.0


def odd_counts(counts: dict[str, dict[int, int]]) -> tuple[str, list[int], int] | None:
    """The first group whose ranks entered different numbers of collectives, and who is odd.

    Args:
        counts: group key -> global rank -> collectives that rank entered on that group.

    Returns:
        ``(group key, odd ranks, the count of the others)``, or None if every group agrees.
        The odd ranks are those off the most common count; with no majority (two ranks), the
        ones behind: they did not enter a collective their peers entered.
    """
    for key, by_rank in sorted(counts.items()):
        if len(set(by_rank.values())) < 2:
            continue
        tally = Counter(by_rank.values())
        top = max(tally.values())
        common = [c for c, n in tally.items() if n == top]
        majority = max(common)  # a tie: the count reached by the ranks ahead
        return key, sorted(r for r, c in by_rank.items() if c != majority), majority
    return None


def _record_error(message: str) -> None:
    """Leave ``message`` in torch elastic's error file, as ``@record`` does for an exception.

    The launcher reads the blame file only beside an error file, and shows its message.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        # Never raised: its "traceback" is empty, and the launcher shows the message instead.
        ErrorHandler().record_exception(CollectiveMismatchAbort(message))
    except Exception:  # dying anyway; the stderr line stays
        logger.debug("abort guard: could not write the error file", exc_info=True)


class CollectiveMismatchAbort(RuntimeError):
    """What a rank that gloo aborted reports: the ranks whose collective counts differ."""


_REMOVED = object()


def _counts_of(record: dict[str, Any] | None) -> dict[str, int]:
    return dict(record.get("counts", {})) if record else {}


class AbortGuard:
    """SIGABRT handler of one process: names the rank that skipped a collective, exits 1.

    Args:
        tracker: this process's :class:`lockstep.diagnose.progress.ProgressTracker`.
    """

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self._handler: Any = None
        self._previous: Any = None
        self._libc: Any = None
        self._lock = threading.Lock()

    @classmethod
    def install(cls, tracker: Any) -> AbortGuard:
        """Catch SIGABRT in this process (not on Windows; a no-op where ctypes cannot)."""
        guard = cls(tracker)
        if not hasattr(signal, "SIGABRT") or sys.platform == "win32":
            return guard
        try:
            libc = ctypes.CDLL(None)
            kind = ctypes.CFUNCTYPE(None, ctypes.c_int)
            guard._handler = kind(guard._on_abort)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            guard._previous = libc.signal(signal.SIGABRT, ctypes.cast(guard._handler, ctypes.c_void_p))
            guard._libc = libc
        except (OSError, AttributeError):
            guard._handler = None
        return guard

    def remove(self) -> None:
        """Give SIGABRT back to the handler that was there before (the handler object is kept:
        a signal being handled may still be running it)."""
        if self._handler is None or self._previous is _REMOVED:
            return
        self._libc.signal(signal.SIGABRT, self._previous)
        self._previous = _REMOVED

    def _on_abort(self, signum: int) -> None:
        # Runs in the aborting thread (gloo's), with the GIL taken by ctypes. One verdict only.
        if not self._lock.acquire(blocking=False):
            return
        # A verdict that cannot be reached (the store's host is gone too) must not turn the
        # abort into a hang: past the deadline the process aborts as it would have.
        timer = threading.Timer(_VERDICT_DEADLINE_S, self._abort_now)
        timer.daemon = True
        timer.start()
        try:
            message = self.verdict()
        except Exception:  # noqa: BLE001 - the store may be gone too: abort as before
            message = None
        timer.cancel()
        if message is None:
            faulthandler.dump_traceback(all_threads=True)
            return  # abort() goes on: SIGABRT, as without the guard
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
        _record_error(message)
        os._exit(1)

    def _abort_now(self) -> None:
        self.remove()
        os.abort()

    def verdict(self) -> str | None:
        """The error naming the rank whose count differs, written as blame; None without one."""
        found = self.tracker
        me = found.rank
        found.publish_now()
        peers = sorted({int(r) for key in found.counts for r in key.split("-")} - {me})
        if not peers:
            return None
        _states, first, _silent = observe_peers(found, found.read(peers))
        # Peers blocked by the mismatch stay where they are; one that still moves was merely
        # behind when an abort of another kind came, and proves nothing.
        _states, latest, _silent = observe_peers(found, first)
        if any(_counts_of(first.get(r)) != _counts_of(latest.get(r)) for r in peers):
            return None
        counts: dict[str, dict[int, int]] = {}
        for key, mine in found.counts.items():
            members = [int(r) for r in key.split("-")]
            by_rank = {me: mine}
            for rank in members:
                record = latest.get(rank)
                if rank != me and record is not None:
                    by_rank[rank] = int(record.get("counts", {}).get(key, 0))
            counts[key] = by_rank
        odd = odd_counts(counts)
        if odd is None:
            return None
        key, ranks, expected = odd
        records = {me: found.snapshot(), **latest}
        described = "; ".join(
            f"rank {r} entered {counts[key][r]} (last: {(records.get(r) or {}).get('last_op') or '?'}, "
            f"step {(records.get(r) or {}).get('step', '?')})" for r in ranks
        )
        message = (
            f"rank {me}: gloo aborted this process: a collective received a message of another "
            f"size (a collective mismatch). The ranks disagree on how many collectives they ran on "
            f"ranks [{key.replace('-', ', ')}]: {described}, where the others entered {expected}. "
            f"Rank(s) {ranks} ran a different sequence of collectives than the others: a "
            "skipped or extra collective (look for a rank-dependent branch or uneven data around "
            "that step), or settings that differ per rank and change how many collectives run or "
            "their sizes (DDP's bucket_cap_mb, find_unused_parameters, static_graph, a comm hook "
            "registered on some ranks only, a dtype). LOCKSTEP_DEBUG_COLLECTIVES=1 checks every "
            "collective before it runs."
        )
        culprits = [{"rank": r, "state": "skipped", "count": counts[key][r], "expected": expected,
                     **{k: (records.get(r) or {}).get(k) for k in ("host", "pid", "local_rank",
                                                                  "step", "phase", "last_op")}}
                    for r in ranks]
        write_blame(me, culprits, message)
        return message
