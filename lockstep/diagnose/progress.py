"""Each rank's progress (step, phase, collectives entered), kept in memory, published aside.

When a collective fails because a peer never arrived, the waiting rank must say who and where
that peer was, without having run an extra collective in the normal case. So on the hot path a
rank only updates a few attributes of its :class:`ProgressTracker` (the DDP step, the phase,
one counter per process group); a daemon thread writes that record to the job's rendezvous
store about once a second (``LOCKSTEP_PROGRESS_INTERVAL``), through its own connection, with a
beat counter that tells the living from the gone. A clean exit publishes a last record marked
``exited``. :mod:`lockstep.diagnose.hang` reads these records when a wait fails.

One tracker per process group of the job (the default group): the record is a fact about this
process, shared by every collective it issues, so it hangs off the group it describes and dies
with it rather than living in a module-level singleton.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep import _torch_compat
from lockstep.diagnose.stackdump import StackDump

__all__ = [
    "INTERVAL_ENV_VAR",
    "GroupProgress",
    "ProgressTracker",
    "close_tracker",
    "default_store",
    "group_progress",
    "tracker",
]

logger = logging.getLogger(__name__)

INTERVAL_ENV_VAR = "LOCKSTEP_PROGRESS_INTERVAL"
_DEFAULT_INTERVAL_S = 1.0
_PREFIX = "lockstep/progress"
# The store answers in milliseconds; a publisher that cannot reach it for this long gives up.
_STORE_TIMEOUT = timedelta(seconds=10)

# One tracker per default process group; weak, so a destroyed group takes its tracker along.
_TRACKERS: weakref.WeakKeyDictionary[Any, ProgressTracker] = weakref.WeakKeyDictionary()
_TRACKERS_LOCK = threading.Lock()
# lockstep's errors that name another rank as the cause: a rank raising one did not fail on its own.
_NAMING_ERRORS = frozenset({"CollectiveTimeoutError", "CollectiveMismatchError"})


def default_store() -> Any:
    """The default group's rendezvous store, or None (no group, or torch keeps it elsewhere).

    lockstep's one way to the store (progress records, the watchdog, the checkpoint meeting).
    """
    if not dist.is_initialized():
        return None
    # torch keeps this store privately; it is the one place every rank can read without
    # joining a collective, which is the point.
    try:
        return _torch_compat.default_store()
    except Exception:  # noqa: BLE001 - private API; without it we lose only the diagnosis
        return None


def publish_interval(environ: dict[str, str] | None = None) -> float:
    """Seconds between two publications (``LOCKSTEP_PROGRESS_INTERVAL``, default 1).

    ``off`` (0.0 here): no records, so a failed collective raises the backend's error at once,
    without naming the peers (``lockstep run --survivors`` sets it: the launcher names the dead).
    """
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV_VAR, "")
    if not raw.strip():
        return _DEFAULT_INTERVAL_S
    if raw.strip().lower() == "off":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"{INTERVAL_ENV_VAR}={raw!r}: expected a positive number of seconds, or off")
    return value


def record_key(rank: int) -> str:
    """Where global rank ``rank`` publishes its record in the store."""
    return f"{_PREFIX}/{rank}"


def group_key(ranks: list[int] | tuple[int, ...]) -> str:
    """Names a group by its global ranks, the same on every member."""
    return "-".join(map(str, ranks))


class ProgressTracker:
    """This process's progress record and the thread that publishes it.

    Hot-path methods (:meth:`set_phase`, :meth:`begin_step`, :meth:`entered`) only write
    attributes. Use :func:`tracker` to get the one of the current job.

    Args:
        store: the job's store (this tracker publishes through a clone: its own connection).
        rank: this process's global rank.
        interval: seconds between publications.
        hosted_peers: when this process hosts the store, every rank of the job: at exit it
            waits a moment for their exit records, since a store that vanishes under a peer
            still publishing makes that peer's torch print a C++ stack trace after a good job.
    """

    def __init__(
        self, store: Any, rank: int, interval: float, hosted_peers: list[int] | None = None
    ) -> None:
        self.rank = rank
        self.hosted_peers = hosted_peers
        self.interval = interval
        self.step = 0
        self.phase = "started"
        self.last_op = ""
        self.counts: dict[str, int] = {}
        self.last_ops: dict[str, str] = {}  # per group: the collective its count last entered
        # GroupProgress per process group, for group_progress() (weak: groups come and go).
        self.groups: weakref.WeakKeyDictionary[Any, GroupProgress] = weakref.WeakKeyDictionary()
        self.host = socket.gethostname()
        self._store = store
        self._beat = 0
        self._state = "running"
        self.error: str | None = None  # the uncaught error that ends this process, if any
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer to the store at a time
        try:
            self._publisher = store.clone()
            self._publisher.set_timeout(_STORE_TIMEOUT)
        except Exception:  # noqa: BLE001 - stores without clone(): share the connection
            self._publisher = store
        self._publish()
        self._thread = threading.Thread(
            target=self._run, name=f"lockstep-progress-{rank}", daemon=True
        )
        self._thread.start()
        # SIGUSR1 dumps this rank's Python stack, for a peer that names it stuck (lockstep.diagnose.hang)
        self._stack = StackDump.install()
        # SIGABRT from gloo (a collective mismatch) names the rank that skipped one, exits 1
        from lockstep.diagnose.abort_guard import AbortGuard  # late: abort_guard reads these records

        self._abort_guard = AbortGuard.install(self)
        # An uncaught error ends the process: its record says so (not that it left the loop
        # early, which is what "exited" alone told the peers that waited for it).
        self._excepthook = sys.excepthook
        sys.excepthook = self._note_uncaught
        atexit.register(self.close)

    def _note_uncaught(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        self.note_error(value)
        self._excepthook(kind, value, tb)

    def note_error(self, exc: BaseException | None) -> None:
        """The error that ends this process (its record then says ``raised``, with its first
        line). Not an interruption, nor lockstep's own naming of another rank."""
        if exc is None or self.error is not None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        if type(exc).__name__ in _NAMING_ERRORS:
            return
        first = str(exc).strip().splitlines()
        self.error = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__

    # ---- hot path: memory only -------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """What this rank does now, e.g. ``"backward"``."""
        self.phase = phase

    def begin_step(self, phase: str) -> None:
        """A new training step starts (DDP counts one per forward that will run backward)."""
        self.step += 1
        self.phase = phase

    def entered(self, key: str, op: str) -> int:
        """Count one more collective on group ``key``; returns its sequence number (1-based)."""
        seq = self.counts.get(key, 0) + 1
        self.counts[key] = seq
        self.last_op = self.last_ops[key] = op
        return seq

    def new_world(self) -> None:
        """Every member of a world re-formed at a step boundary (``lockstep.Survivors``) starts
        its counts again: a replacement that joins counts from 0, and ranks that keep theirs
        would take it for behind by every collective they ran before."""
        self.counts.clear()
        self.last_ops.clear()

    # ---- publication ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """This rank's record as published."""
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
            "step": self.step,
            "phase": self.phase,
            "last_op": self.last_op,
            "counts": dict(self.counts),
            "last_ops": dict(self.last_ops),
            "beat": self._beat,
            "state": self._state,
            **({"error": self.error[:300]} if self.error else {}),
        }

    def publish_now(self) -> None:
        """Publish this rank's record at once (a dying rank's last word; see lockstep.diagnose.abort_guard)."""
        self._publish()

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            self._publisher.set(record_key(self.rank), json.dumps(self.snapshot()))

    def _run(self) -> None:
        # Published every interval even when unchanged: the beat is how peers tell a rank that
        # is stuck but alive from one that is gone.
        while not self._stop.wait(self.interval):
            try:
                self._publish()
            except Exception:
                logger.debug("progress: the store is unreachable; stop publishing", exc_info=True)
                return

    def close(self) -> None:
        """Publish a last record marked ``exited`` and stop; safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._stack.remove()
        self._abort_guard.remove()
        self._thread.join(timeout=self.interval)
        if sys.excepthook == self._note_uncaught:
            sys.excepthook = self._excepthook
        # Closed while an error propagates (destroy_process_group in a `finally:`, or the
        # launcher's worker reporting it): the error ends the process.
        self.note_error(sys.exc_info()[1])
        self._state = "raised" if self.error else "exited"
        try:
            self._publish()
            if self.hosted_peers:
                self._await_exits(self.hosted_peers, time.monotonic() + 2 * self.interval)
        except Exception:
            logger.debug("progress: could not publish the exit record", exc_info=True)
        atexit.unregister(self.close)
        # The groups' records are done with: dropped, they hold no group (and so no store) open
        # past its destruction (a rank 0 joining a new group in this process hosts a new one).
        self.groups.clear()

    def _await_exits(self, peers: list[int], deadline: float) -> None:
        waiting = set(peers) - {self.rank}
        while waiting and time.monotonic() < deadline:
            records = self.read(sorted(waiting))
            waiting = {r for r, rec in records.items()
                       if not rec or rec["state"] not in ("exited", "raised")}
            time.sleep(0.05)

    # ---- reading peers ------------------------------------------------------------------------
    def read(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        """Every rank's last published record (None: it never published one)."""
        out: dict[int, dict[str, Any] | None] = {}
        for rank in ranks:
            key = record_key(rank)
            out[rank] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return out


def note_error(exc: BaseException) -> None:
    """Record ``exc`` as the error that ends this process in its progress record, if it
    publishes one (the launcher's worker calls it: it prints the error itself, so Python's
    ``sys.excepthook`` never sees it)."""
    with _TRACKERS_LOCK:
        found = list(_TRACKERS.values())
    for each in found:
        each.note_error(exc)


def tracker() -> ProgressTracker | None:
    """The tracker of the current job, started on first use; None in a world of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or publish_interval() == 0.0:
        return None
    world = dist.group.WORLD
    with _TRACKERS_LOCK:
        found = _TRACKERS.get(world)
        if found is None:
            store = default_store()
            if store is None:
                return None
            found = ProgressTracker(
                store, dist.get_rank(), publish_interval(), _peers_if_hosting_store()
            )
            _TRACKERS[world] = found
        return found


def close_tracker() -> None:
    """Publish this rank's exit record (call before destroying the default group)."""
    if not dist.is_initialized():
        return
    with _TRACKERS_LOCK:
        found = _TRACKERS.pop(dist.group.WORLD, None)
    if found is not None:
        found.close()


def _peers_if_hosting_store() -> list[int] | None:
    # Under torchrun and `lockstep run` the agent hosts the store and outlives the workers;
    # otherwise (lockstep.spawn, srun, tcp://) rank 0 does.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    return list(range(dist.get_world_size())) if dist.get_rank() == 0 else None


class GroupProgress:
    """The collectives one component issues on one group, counted in the job's tracker.

    Build it once (e.g. in a constructor); :meth:`enter` is then a dictionary update.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.key = group_key(self.ranks)
        self.tracker = tracker()

    def enter(self, op: str) -> int:
        """Record that this rank enters collective ``op``; returns its sequence number."""
        found = self.tracker
        return found.entered(self.key, op) if found is not None else 0

    def set_phase(self, phase: str) -> None:
        if self.tracker is not None:
            self.tracker.set_phase(phase)

    def begin_step(self, phase: str) -> None:
        if self.tracker is not None:
            self.tracker.begin_step(phase)


def group_progress(group: Any = None) -> GroupProgress:
    """The :class:`GroupProgress` of ``group`` (``None``: the default group), built once.

    For code that has no object to keep one in (a module-level function on the hot path).
    """
    found = tracker()
    key = group if group is not None else dist.group.WORLD
    cache = found.groups if found is not None else None
    cached = cache.get(key) if cache is not None else None
    if cached is None:
        cached = GroupProgress(group)
        if cache is not None:
            cache[key] = cached
    return cached
