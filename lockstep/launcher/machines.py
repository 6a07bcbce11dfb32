"""The machines of a ``lockstep run --survivors`` job on several machines: who is still there.

Every machine's launcher shares the job's store (hosted by machine 0's launcher) and, each
time it checks on its workers, counts up its heartbeat (``node/<n>/beat``) and keeps the slots
and pids of its workers there (``node/<n>/ranks``). A launcher that sees another machine's
heartbeat stand still for ``timeout`` seconds (on its own clock: no two machines' clocks are
compared) counts that machine lost: it marks the machine's ranks dead, so the survivors' roll
call ends, and announces the loss (``loss/<k>``), so survivors blocked in a collective with a
machine that vanished without closing its connections stop waiting
(:mod:`lockstep.resilience.losses`). A launcher started again for a machine (a replacement
machine, same ``--node-rank``) marks the ranks of the one before it dead at once and starts its
workers as replacements, which join the survivors at a step boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from lockstep.resilience.roster import dead_key

__all__ = ["Machines"]


def _encode(ranks: Mapping[int, int]) -> str:
    return ",".join(f"{slot}:{pid}" for slot, pid in sorted(ranks.items()))


def _decode(text: str) -> dict[int, int]:
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(slot): int(pid) for slot, pid in pairs}


class Machines:
    """This machine's heartbeat and its view of the others (a survivors job's launcher).

    Args:
        store: the job's store, inside the survivors' keys.
        node: this machine's ``--node-rank``.
        nnodes: how many machines the job has.
        timeout: seconds without a heartbeat before a machine counts as lost.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, store: Any, node: int, nnodes: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout > 0:
            raise ValueError(f"--node-timeout {timeout}: must be positive seconds")
        self.store, self.node, self.nnodes, self.timeout = store, node, nnodes, timeout
        self._clock = clock
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last count seen, when)
        self.lost: set[int] = set()  # machines counted lost (until they beat again)
        self.incarnation = int(store.add(f"node/{node}/starts", 1))
        self._registered = ""

    @property
    def replacement(self) -> bool:
        """Was a launcher for this machine started before (this one replaces a lost machine)?"""
        return self.incarnation > 1

    def retire_predecessor(self) -> dict[int, int]:
        """A replacement machine: mark the ranks of the launcher before it dead (slot -> pid)."""
        key = f"node/{self.node}/ranks"
        if not self.replacement or not self.store.check([key]):
            return {}
        ranks = _decode(self.store.get(key).decode())
        for slot, pid in ranks.items():
            self.store.set(dead_key(slot, pid), "machine replaced")
        return ranks

    def beat(self, ranks: Mapping[int, int]) -> None:
        """Say this machine is here, with its workers (slot -> pid) when they changed."""
        self.store.add(f"node/{self.node}/beat", 1)
        text = _encode(ranks)
        if text != self._registered:
            self.store.set(f"node/{self.node}/ranks", text)
            self._registered = text

    def finished(self) -> None:
        """Every worker of this machine ended well: it is not lost when it stops beating."""
        self.store.set(f"node/{self.node}/done", "1")

    def is_done(self, node: int) -> bool:
        return bool(self.store.check([f"node/{node}/done"]))

    def check(self) -> dict[int, dict[int, int]]:
        """The machines newly counted lost, each with the ranks marked dead (slot -> pid)."""
        now, newly = self._clock(), {}
        for node in range(self.nnodes):
            if node == self.node or self.is_done(node):
                continue
            count = int(self.store.add(f"node/{node}/beat", 0))
            last = self._beats.get(node)
            if last is None or count != last[0]:
                self._beats[node] = (count, now)
                self.lost.discard(node)  # beating (again: a replacement machine)
                continue
            if count == 0 or node in self.lost or now - last[1] < self.timeout:
                continue  # not started yet, already counted, or not late yet
            self.lost.add(node)
            newly[node] = self._declare_lost(node)
        return newly

    def _declare_lost(self, node: int) -> dict[int, int]:
        key = f"node/{node}/ranks"
        ranks = _decode(self.store.get(key).decode()) if self.store.check([key]) else {}
        for slot, pid in ranks.items():
            self.store.set(dead_key(slot, pid), f"machine {node} lost")
        count = int(self.store.add("losses", 1))
        self.store.set(f"loss/{count}", str(node))
        return ranks

    def never_seen(self) -> list[int]:
        """The other machines whose launcher has not beaten yet (not started, or elsewhere)."""
        return [node for node in range(self.nnodes) if node != self.node
                and self._beats.get(node, (0, 0.0))[0] == 0 and not self.is_done(node)]

    def others_alive(self) -> bool:
        """Is another machine still beating and not finished (someone to take a worker in)?"""
        return any(node != self.node and node not in self.lost and not self.is_done(node)
                   and self._beats.get(node, (0, 0.0))[0] > 0 for node in range(self.nnodes))

    def wait_for_others(self, limit: float, poll: float = 0.1) -> list[int]:
        """Machine 0, whose launcher hosts the store: wait until every other machine finished
        or is lost (at most ``limit`` seconds); returns those still running then."""
        deadline = self._clock() + limit
        while True:
            self.check()
            running = [n for n in range(self.nnodes)
                       if n != self.node and n not in self.lost and not self.is_done(n)]
            if not running or self._clock() > deadline:
                return running
            time.sleep(poll)
