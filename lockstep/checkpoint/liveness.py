"""Whether another rank's process is still alive, told through the checkpoint directory.

Rank 0's writing thread waits for every other rank to mark its files written (``background.py``).
A rank that was killed never will, and without a sign of its death rank 0 waits out its whole
bound: after a SIGTERM that stalled every restart of a job that saves each step by up to 10 s.

So each process that makes an asynchronous save holds a POSIX record lock on a file of its own,
``.lockstep-alive/<host>-<pid>`` in the checkpoint directory, from its first such save until it
ends, and tells the others the file's name in the save's agreement. The kernel drops the lock
when the process dies, SIGKILL included, so rank 0 can tell "still writing" from "gone" by
trying to take the lock itself. Record locks are the kind that fit: a child made by ``fork`` (a
DataLoader worker) does not inherit them, so it cannot keep a dead rank looking alive, and NFS
carries them between machines. One file per process, not per rank: ranks are renumbered when
the world changes (``lockstep.Survivors``), processes are not.

Only a positive answer is trusted: where the file is missing (a directory that is not shared),
where the filesystem has no locks, or where the name is that of a process still running on this
machine, the rank counts as alive and rank 0 waits as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from lockstep.env import process_runs

try:
    import fcntl
except ImportError:  # not POSIX: no liveness locks, and rank 0 waits out its bound as before
    fcntl = None  # type: ignore[assignment]

__all__ = ["ALIVE_DIR", "LivenessLocks", "is_gone"]

ALIVE_DIR = ".lockstep-alive"


class LivenessLocks:
    """The liveness locks this process holds, one per checkpoint directory.

    One instance per process (``background.py`` keeps it beside its other per-process record,
    the writes in flight): POSIX locks belong to the process, and closing any descriptor of a
    locked file drops them, so two owners in one process would undo each other.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, str, int]] = {}  # directory -> (pid, name, descriptor)
        self._lock = threading.Lock()

    def hold(self, directory: Path, sweep: bool = False) -> str | None:
        """Hold this process's lock in ``directory``; its file's name (``None``: not held).

        Never raises: without the lock rank 0 only waits longer for this rank if it dies.
        ``sweep``: first remove the files of processes that have ended (rank 0, once).
        """
        key = os.path.abspath(directory)
        pid = os.getpid()
        with self._lock:
            held = self._held.get(key)
            if held is not None and held[0] == pid:
                return held[1]
            # Not held, or held by the process this one was forked from: its lock is not ours.
            folder = Path(directory) / ALIVE_DIR
            if fcntl is None or not _make(folder):
                return None
            if sweep:
                _sweep(folder)
            name = f"{socket.gethostname()}-{pid}"
            fd = _lock(folder / name)
            if fd is None:
                return None
            self._held[key] = (pid, name, fd)
            return name

    def holds(self, directory: Path, name: str) -> bool:
        """Whether ``name`` in ``directory`` is this process's own file."""
        held = self._held.get(os.path.abspath(directory))
        return held is not None and held[0] == os.getpid() and held[1] == name


def _make(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return True


def _lock(path: Path) -> int | None:
    for _ in range(3):  # a sweep may remove the file between its creation and its lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except OSError:  # no locks on this filesystem, or the file is gone again
            pass
        os.close(fd)
    return None


def _sweep(folder: Path) -> None:
    """Remove the files of processes that have ended (their lock is free)."""
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink()
                except OSError:
                    pass  # held: a live process's
                finally:
                    os.close(fd)


def is_gone(directory: Path, name: str | None, locks: LivenessLocks) -> bool:
    """Whether the process that holds ``name`` (told in the save's agreement) has ended: its
    file is there and unlocked. False whenever in doubt."""
    if fcntl is None or not name or "/" in name or locks.holds(directory, name):
        return False  # our own lock: POSIX locks never conflict within a process
    try:
        fd = os.open(Path(directory) / ALIVE_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # not there: a directory that is not shared between the machines
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # EAGAIN/EACCES: held, so alive; anything else (ENOLCK...): can't tell
        return False
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return not _runs_here(name)


def _runs_here(name: str) -> bool:
    """Whether ``name`` is that of a process still running on this machine (a lock lost
    without its process ending must not be read as a death)."""
    host, _, pid = name.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return process_runs(int(pid))
