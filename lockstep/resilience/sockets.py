"""Close a failed process group's connections now, so peers blocked on this rank fail at once.

When a rank dies, only the peers that exchange data with it directly see an error; a survivor
that waits on another survivor stays blocked until the collective timeout (minutes), because
neither ``abort()`` nor ``destroy_process_group()`` closes gloo's sockets while anything still
holds the group. So the sockets the group opened are noted when it is made (the process's
socket descriptors before and after, each with its inode so that a number reused later is never
touched) and shut down when the group fails: every peer blocked on this rank gets "connection
closed" at once and joins the roll call. Listening sockets are left alone (gloo's listener
thread treats a failed ``accept`` as fatal). Linux only (``/proc/self/fd``); elsewhere nothing
is noted and the collective timeout applies.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

__all__ = ["GroupSockets", "open_sockets"]


def open_sockets() -> dict[int, int]:
    """This process's socket descriptors and their inodes (empty where /proc is missing)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            info = os.fstat(int(name))
            if stat.S_ISSOCK(info.st_mode):
                found[int(name)] = info.st_ino
    return found


class GroupSockets:
    """The inet sockets opened between :meth:`before` and :meth:`after` (a group's creation)."""

    def __init__(self) -> None:
        self._before: dict[int, int] = {}
        self.sockets: dict[int, int] = {}

    def before(self) -> None:
        self._before = open_sockets()

    def after(self) -> None:
        self.sockets = {fd: ino for fd, ino in open_sockets().items()
                        if self._before.get(fd) != ino}

    def shutdown(self) -> int:
        """Shut down the noted connections still open; returns how many were."""
        done = 0
        for fd, inode in self.sockets.items():
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino != inode:
                    continue  # closed, and the number reused by something else
                sock = socket.socket(fileno=os.dup(fd))
                try:
                    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    if sock.family in (socket.AF_INET, socket.AF_INET6) and not listening:
                        sock.shutdown(socket.SHUT_RDWR)
                        done += 1
                finally:
                    sock.close()
        self.sockets = {}
        return done
