"""Stop waiting on a machine that vanished (``lockstep run --survivors`` on several machines).

A process that dies closes its connections, and its peers' next collective fails at once. A
machine that loses power or its network closes nothing: its peers would wait in the collective
until the process group's timeout (minutes). The launchers of a job on several machines hear
from each other through the job's store; one that has not been heard from for
``--node-timeout`` seconds is counted lost, its ranks are marked dead and the loss is announced
(``loss/<n>``, see :mod:`lockstep.resilience.roster`). :class:`LossWatch`, a thread in every
worker, waits for those announcements; when a member of the current world is among the dead, it
calls ``act`` (the caller shuts the group's connections): the blocked collective fails and the
roll call starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LossWatch"]


class LossWatch:
    """A daemon thread that runs ``act()`` after each announced loss for which ``affected(store)``
    is true, under ``lock`` (the caller holds it while it changes what ``affected`` reads).

    ``connect()`` returns the thread's own client of the job's store (a store client is not
    shared between threads); ``poll``: seconds between two looks at the store (a look is one
    small request; the store's own ``wait`` logs a warning at every timeout, so it is not used).
    """

    def __init__(self, connect: Callable[[], Any], affected: Callable[[Any], bool],
                 act: Callable[[], object], lock: threading.Lock, poll: float = 0.25) -> None:
        self._connect, self._affected, self._act = connect, affected, act
        self._lock, self._poll = lock, poll
        self._stopped = threading.Event()
        self.acted = 0  # how many losses touched this world (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="lockstep-loss-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it notices within ``poll`` seconds)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll * 4 + 1)

    def _run(self) -> None:
        try:
            store = self._connect()
            seen = int(store.add("losses", 0))
        except Exception:  # noqa: BLE001 - no store: the collective timeout applies, as before
            return
        while not self._stopped.wait(self._poll):
            try:
                if not store.check([f"loss/{seen + 1}"]):
                    continue
            except Exception:  # noqa: BLE001 - the job's store went away: the job is over
                return
            seen += 1
            with self._lock:
                try:
                    hit = self._affected(store)
                except Exception:  # noqa: BLE001 - the store went away meanwhile
                    return
                if hit:
                    self._act()
                    self.acted += 1
