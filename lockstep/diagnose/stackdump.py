"""A stuck rank's Python stack, on request: each rank installs a dump on ``SIGUSR1``.

When a rank names a peer that is alive but stuck (:mod:`lockstep.diagnose.hang`), it sends that peer
``SIGUSR1`` (same host only: a signal needs the pid on this machine). The peer's
:mod:`faulthandler` writes every thread's Python stack to a file named after its pid, which the
naming rank reads and puts next to the peer's name. faulthandler writes from the signal handler
itself, so a rank stuck in a Python loop and one blocked inside a collective (C++) both answer.

``SIGUSR1`` is left alone when the script already handles it (its handler is kept).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
from typing import IO

__all__ = ["StackDump", "request_stack", "stack_file"]

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # absent on Windows: no dumps there


def stack_file(pid: int) -> str:
    """Where process ``pid`` (on this host) writes its stack when asked."""
    return os.path.join(tempfile.gettempdir(), f"lockstep-stack-{pid}.txt")


class StackDump:
    """This process's dump-on-signal; :meth:`remove` undoes it and deletes the file."""

    def __init__(self, fh: IO[str] | None) -> None:
        self._fh = fh

    @classmethod
    def install(cls) -> StackDump:
        if STACK_SIGNAL is None or signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
            return cls(None)  # the script (or a library) handles SIGUSR1 already
        try:
            fh = open(stack_file(os.getpid()), "w")  # noqa: SIM115 - faulthandler keeps it open
            faulthandler.register(STACK_SIGNAL, file=fh, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError):
            return cls(None)
        return cls(fh)

    @property
    def active(self) -> bool:
        return self._fh is not None

    def remove(self) -> None:
        if self._fh is None or STACK_SIGNAL is None:
            return
        faulthandler.unregister(STACK_SIGNAL)
        name = self._fh.name
        self._fh.close()
        self._fh = None
        try:
            os.unlink(name)
        except OSError:
            pass


def request_stack(pid: int, wait_s: float = 1.0) -> str | None:
    """Ask process ``pid`` on this host for its Python stack; the text, or None if none came."""
    path = stack_file(pid)
    if STACK_SIGNAL is None or not os.path.exists(path):
        return None  # not a lockstep rank on this host, or it did not install the dump
    try:
        before = os.path.getsize(path)
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return None
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path) if os.path.exists(path) else size
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    try:
        with open(path) as fh:
            fh.seek(before)
            text = fh.read().strip()
    except OSError:
        return None
    return text or None
