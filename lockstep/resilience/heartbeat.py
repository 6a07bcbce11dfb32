"""Tell a frozen worker from a busy one (``lockstep run --survivors``).

A worker that dies closes its connections and its launcher sees it exit. One that is frozen (a
SIGSTOP, a process stuck in the kernel, a C call that hangs holding Python's lock) does
neither: its peers wait in their collective and the launcher waits with them. So each worker
of a survivors job runs :class:`Heartbeat`, a daemon thread that counts up ``beat/<node>/<pid>``
in the job's store every ``interval`` seconds from the start of ``lockstep.Survivors()``; a
frozen process stops counting (every thread of it stops), while a busy one (a long step, a first
compile, a checkpoint write, a collective that waits) goes on, since the thread needs only a
moment of Python's lock now and then. The launcher's :class:`Silence` notes each worker's count;
one that stands still for ``timeout`` seconds counts the worker frozen: the launcher kills it
with SIGKILL and it is lost exactly as if it had died (marked dead, replaced).

The timeout is ``LOCKSTEP_SURVIVORS_HEARTBEAT_TIMEOUT`` (seconds, default
:data:`DEFAULT_TIMEOUT`; ``off`` turns the watch off) in the launcher's environment, which its
workers inherit: they beat ten times per timeout (at most once a second).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "Heartbeat", "Silence", "beat_interval",
           "beat_key", "describe_state", "heartbeat_timeout"]

TIMEOUT_ENV = "LOCKSTEP_SURVIVORS_HEARTBEAT_TIMEOUT"
DEFAULT_TIMEOUT = 60.0  # seconds without a beat: far beyond a GC pause or a slow store reply
_OFF = 1 << 40  # taken from a count when its process stops beating on purpose (at its exit)


def heartbeat_timeout(environ: dict[str, str] | None = None) -> float | None:
    """The timeout set by :data:`TIMEOUT_ENV` in ``environ`` (``os.environ``); None: off.

    Raises:
        ValueError: the value is neither ``off`` nor positive seconds.
    """
    text = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    if text.lower() == "off":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give positive seconds (default "
                         f"{DEFAULT_TIMEOUT:g}), or 'off' to never count a silent worker lost")
    return seconds


def beat_interval(timeout: float) -> float:
    """How often a worker beats: ten beats per ``timeout``, at most one a second."""
    return min(1.0, timeout / 10)


def beat_key(node: int, pid: int) -> str:
    """The counter a worker (process ``pid`` of machine ``node``) counts up in the job's store."""
    return f"beat/{node}/{pid}"


class Heartbeat:
    """A daemon thread counting up ``key`` in a store every ``interval`` seconds.

    ``connect()`` returns the thread's own client of the job's store (a client is not shared
    between threads). A failed store call ends the thread: the job's store is gone, so the
    launcher that would watch the beats is gone too.
    """

    def __init__(self, connect: Callable[[], Any], key: str, interval: float) -> None:
        self._connect, self._key, self._interval = connect, key, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it notices within ``interval`` seconds)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval * 2 + 1)

    def _run(self) -> None:
        try:
            store = self._connect()
            while True:
                store.add(self._key, 1)
                if self._stopped.wait(self._interval):
                    # Below zero: stopped on purpose (the process exits), not to be watched.
                    store.add(self._key, -_OFF)
                    return
        except Exception:  # noqa: BLE001 - no store: nobody watches the beats any more
            return


class Silence:
    """The launcher's view of its workers' beats: who has been silent for ``timeout`` seconds.

    A process is watched from its first beat (sent when ``lockstep.Survivors()`` starts) until
    it stops beating on purpose at its exit (the count then drops below zero): before its first
    beat, the process may be importing torch or running the script's own code, for as long as
    that takes.

    Args:
        count: ``count(pid)``, that process's beats so far (0: none yet).
        timeout: seconds a count may stand still.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, count: Callable[[int], int], timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._count, self.timeout, self._clock = count, timeout, clock
        self._seen: dict[int, tuple[int, float]] = {}  # pid -> (count, when it last changed)

    def silent(self, pids: Iterable[int]) -> dict[int, float]:
        """Those of ``pids`` whose count stood still for ``timeout`` (pid -> seconds silent)."""
        now, found = self._clock(), {}
        pids = list(pids)
        for pid in pids:
            count = self._count(pid)
            last = self._seen.get(pid)
            if last is None or count != last[0]:
                self._seen[pid] = (count, now)
            elif count > 0 and now - last[1] >= self.timeout:
                found[pid] = now - last[1]
        for gone in set(self._seen) - set(pids):
            del self._seen[gone]
        return found


_STATES = {
    "T": "stopped (SIGSTOP, or a debugger)",
    "t": "stopped by a debugger",
    "D": "waiting in the kernel (uninterruptible)",
    "Z": "a zombie",
}


def describe_state(pid: int) -> str:
    """What the kernel says process ``pid`` is doing, in words (Linux; elsewhere '')."""
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return _STATES.get(state, "running or sleeping, yet its heartbeat thread got no turn "
                                  "(a C call holding Python's lock?)")
    return ""
