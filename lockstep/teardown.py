"""Leaving the job safely: no backend thread may touch Python once the interpreter finalizes.

Why a finished job could end in SIGABRT ("terminate called without an active exception"):
gloo runs every collective on its own worker threads (``pt_gloo_runloop``). A moment *after*
the main thread has seen a collective finish, its worker thread still releases what the
collective held: the Python callback of a ``Future.then`` (every DDP comm hook) and the
collective's tensors, both of which need the GIL. If the main thread reaches interpreter
finalization first, CPython ends the late thread with ``pthread_exit`` when it asks for the
GIL; the unwind crosses a C++ destructor that may not throw, and the process aborts after all
its work is done. ``destroy_process_group`` avoids it only when it drops the *last* reference
to the group, because only then does torch join those threads (with the GIL released): a live
DDP model, or one in a reference cycle, still holds the group.

:func:`quiesce` therefore runs while the interpreter is still whole (from ``atexit``, and from
:func:`lockstep.shutdown_distributed`): it collects unreachable objects, so that a dead model
lets go of the group and torch joins its threads, then waits, with the GIL released, until every
gloo worker thread left (a group held by a live object) is parked on its empty work queue.
"""

from __future__ import annotations

import gc
import os
import platform
import time

__all__ = ["backend_threads", "quiesce"]

_WORKER_NAME = "pt_gloo_runloop"  # torch names gloo's worker threads so
_TASKS = "/proc/self/task"
# futex(2)'s number, where /proc/<tid>/syscall reports it.
_FUTEX = {"x86_64": "202", "aarch64": "98", "arm64": "98"}
_POLL_S = 0.002
# Where the threads' state cannot be read (not Linux): time enough to finish a release.
_BLIND_GRACE_S = 0.05


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:  # the thread ended meanwhile, or no /proc
        return None


def backend_threads() -> list[str] | None:
    """Thread ids of this process's gloo worker threads; None where /proc cannot tell."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    return [tid for tid in tids if _read(f"{_TASKS}/{tid}/comm") == _WORKER_NAME]


def _parked(tid: str) -> bool | None:
    """True when the thread sleeps in a futex wait *without* a timeout: its idle queue wait.

    A thread waiting for the GIL sleeps with a timeout (CPython re-checks every few
    milliseconds), a running one reports ``running``: neither counts as parked. None where the
    architecture's syscall numbers are unknown.
    """
    futex = _FUTEX.get(platform.machine())
    fields = (_read(f"{_TASKS}/{tid}/syscall") or "").split()
    if futex is None:
        return None
    if not fields:
        return True  # gone
    # fields: number, six arguments (uaddr, op, val, timeout, ...), stack and instruction ptrs
    return fields[0] == futex and len(fields) > 4 and fields[4] == "0x0"


def quiesce(timeout: float = 10.0) -> bool:
    """Wait until no gloo worker thread of this process can still need the GIL.

    Call with no collective in flight (after the last one finished, or after the process
    group was destroyed).

    Returns:
        True when every worker thread ended or was seen parked twice in a row; False when
        ``timeout`` passed first or the state could not be read (then after a short grace).
    """
    gc.collect()  # a dead DDP model in a reference cycle lets go of the group: torch joins
    deadline = time.monotonic() + timeout
    calm = 0
    while time.monotonic() < deadline:
        tids = backend_threads()
        if tids is None:
            time.sleep(_BLIND_GRACE_S)
            return False
        states = [_parked(tid) for tid in tids]
        if any(state is None for state in states):
            time.sleep(_BLIND_GRACE_S)
            return False
        calm = calm + 1 if all(states) else 0
        if calm >= 2:
            return True
        time.sleep(_POLL_S)  # releases the GIL: a late release can take it now
    return False
