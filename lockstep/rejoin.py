"""Joining a new default group after leaving one: wait until the old rendezvous store is gone.

Under ``lockstep.spawn``, srun or plain ``tcp://``, rank 0 hosts the job's store on
``MASTER_PORT`` inside its own process, and the store lives until rank 0 destroys its group.
A rank that shuts down and calls ``init_distributed`` again before that would connect to the
old store, read the first job's addresses and fail in gloo (``Connection refused``). Rank 0
leaves last on purpose (it waits a moment for its peers' exit records), so this is the usual
order, not a rare race.

So on leaving, a rank that does not host the store opens a plain TCP connection to it (it
sends nothing: the store's server keeps such a connection until it shuts down, and closes
it then). The next ``init_distributed`` in the process waits for that connection to close
before it meets the others. A process that never joins again just closes the socket at exit:
leaving costs one connect, nothing is waited for. Stores hosted outside the workers (torchrun's
and ``lockstep run``'s agent) outlive every worker and are not watched.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

__all__ = ["LeftGroups", "PreviousStore", "StoreStillOpenError", "store_address"]


class StoreStillOpenError(RuntimeError):
    """The previous group's store (hosted by rank 0) did not close in time for a new group."""


def store_address(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store under ``store`` (through its prefixes), or None."""
    seen = 0
    while hasattr(store, "underlying_store") and seen < 16:
        store = store.underlying_store
        seen += 1
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    return host, port


class PreviousStore:
    """A silent connection to the store of a group this process left, until that store closes.

    Args:
        address: the store's ``(host, port)``.
        connect_timeout: seconds to wait for the connection itself.
    """

    def __init__(self, address: tuple[str, int], connect_timeout: float = 2.0) -> None:
        self.address = address
        self._sock: socket.socket | None = socket.create_connection(address, timeout=connect_timeout)

    @classmethod
    def watch(cls, store: Any, rank: int, environ: dict[str, str] | None = None) -> PreviousStore | None:
        """A watch on ``store`` where another process of the job hosts it, else None.

        Never raises: without a watch a new group only loses this protection.
        """
        env = os.environ if environ is None else environ
        if rank == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return None
        address = store_address(store)
        if address is None:
            return None
        try:
            return cls(address)
        except OSError:
            return None  # already gone: nothing to wait for

    def closed(self) -> bool:
        """Whether the store has closed (then this watch is closed too)."""
        if self._sock is None:
            return True
        self._sock.settimeout(0.0)
        try:
            data = self._sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""  # reset: gone as well
        if data:
            return False  # the server never speaks first; tolerate it rather than guess
        self.close()
        return True

    def wait_closed(self, timeout: float) -> None:
        """Return once the store has closed.

        Raises:
            StoreStillOpenError: still open after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        delay = 0.001
        while not self.closed():
            left = deadline - time.monotonic()
            if left <= 0:
                host, port = self.address
                self.close()
                raise StoreStillOpenError(
                    f"the previous group's store at {host}:{port}, hosted by rank 0, is still "
                    f"open {timeout:.0f} s after this rank left that group, so a new group on "
                    "the same address would meet the old job's records. Have rank 0 leave "
                    "too (lockstep.shutdown_distributed() or dist.destroy_process_group(), "
                    "and drop what still holds its store) before every rank joins again, or "
                    "use another MASTER_PORT for the new group."
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        """Stop watching; safe to call twice."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class LeftGroups:
    """What a process remembers of the default groups it left: how many, and the last one's store."""

    def __init__(self) -> None:
        self.count = 0
        self.store: PreviousStore | None = None

    def left(self, store: Any, rank: int) -> None:
        """This rank is leaving the group whose store is ``store`` (call before destroying it)."""
        self.forget_store()
        self.count += 1
        self.store = PreviousStore.watch(store, rank)

    def prefix(self) -> str | None:
        """The store prefix of the next group's keys: None (torch's own) for a first group."""
        return f"default_pg/lockstep-rejoin-{self.count}" if self.count else None

    def before_join(self, port: int, timeout: float) -> None:
        """Let the last group's store close if the next group meets on the same ``port``.

        Raises:
            StoreStillOpenError: it is still open after ``timeout`` seconds.
        """
        watch, self.store = self.store, None
        if watch is None:
            return
        try:
            if watch.address[1] == port:
                watch.wait_closed(timeout)
        finally:
            watch.close()

    def forget_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
