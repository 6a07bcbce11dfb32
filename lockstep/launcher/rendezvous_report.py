"""The rendezvous as the user sees it: who is waited for, who joined or left, and why.

torch's dynamic rendezvous says nothing while it waits (a machine 25 s late is 25 s of silence;
a mistyped endpoint is ten minutes of it) and restarts a job silently when a machine is lost.
A :class:`Meeting` watches a launcher's rendezvous and says, on the launcher's console:

- while waiting, a line every few seconds (``LOCKSTEP_RDZV_REPORT_INTERVAL``, default 5):
  where, which job, how many machines joined and when it gives up, and any launcher that
  reached the endpoint with a different ``--rdzv-id`` or ``--nnodes``;
- at the join timeout, what was seen and what to check;
- once a round completes, which machines (host, ranks) make up the world, and on a restart
  which machines left (with what their peers saw: the step, whether the launcher stopped
  answering) or joined, and the new world size.

Everything here is pure formatting over plain :class:`RoundView` snapshots, so it is tested
without processes; :mod:`~lockstep.launcher.rendezvous` builds the snapshots from torch's state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REPORT_INTERVAL_ENV_VAR",
    "Meeting",
    "Member",
    "RoundView",
    "Visitor",
    "describe_machine",
    "rank_ranges",
    "report_interval",
    "say_on_stderr",
]

logger = logging.getLogger(__name__)

REPORT_INTERVAL_ENV_VAR = "LOCKSTEP_RDZV_REPORT_INTERVAL"
_DEFAULT_REPORT_S = 5.0


def report_interval(environ: dict[str, str] | None = None) -> float:
    """Seconds between two waiting lines (``LOCKSTEP_RDZV_REPORT_INTERVAL``, default 5)."""
    raw = (os.environ if environ is None else environ).get(REPORT_INTERVAL_ENV_VAR, "").strip()
    if not raw:
        return _DEFAULT_REPORT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"{REPORT_INTERVAL_ENV_VAR}={raw!r}: expected a positive number of seconds"
        )
    return value


def say_on_stderr(line: str) -> None:
    """The launcher's own voice: one line on stderr, prefixed like its other messages."""
    print(f"lockstep run: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Member:
    """One launcher (machine) in the rendezvous."""

    key: str  # unique per launcher: host, pid and a counter
    host: str
    rank: int  # the machine's rank in the round (-1 while waiting)
    nproc: int | None = None  # its workers, if it published them


@dataclass(frozen=True)
class RoundView:
    """What a launcher knows of the rendezvous at one moment."""

    round: int
    complete: bool
    members: tuple[Member, ...]  # participants, in machine-rank order
    waiting: tuple[Member, ...] = ()  # launchers waiting for the next round
    heartbeat_age: dict[str, float] = field(default_factory=dict)  # key -> seconds

    def hosts(self) -> list[str]:
        return [m.host for m in self.members] + [m.host for m in self.waiting]


@dataclass(frozen=True)
class Visitor:
    """A launcher that reached the endpoint, whatever job it asked for."""

    key: str
    host: str
    pid: int
    run_id: str
    nnodes: str


def rank_ranges(members: tuple[Member, ...]) -> dict[str, tuple[int, int]]:
    """Each member's global ranks (first, last): machines in rank order, workers in turn."""
    ranges, start = {}, 0
    for member in sorted(members, key=lambda m: m.rank):
        count = member.nproc or 0
        ranges[member.key] = (start, start + count - 1)
        start += count
    return ranges


def describe_machine(member: Member, ranges: dict[str, tuple[int, int]]) -> str:
    """``machine 1 (host-b, ranks 2-3)``."""
    first, last = ranges.get(member.key, (-1, -2))
    if last < first:
        return f"machine {member.rank} ({member.host})"
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"machine {member.rank} ({member.host}, {ranks})"


def _world(members: tuple[Member, ...]) -> int | None:
    counts = [m.nproc for m in members]
    return None if any(c is None for c in counts) else sum(c or 0 for c in counts)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


class Meeting:
    """Says what one launcher's rendezvous is doing (see the module docstring).

    Args:
        endpoint: ``HOST:PORT`` the machines meet at.
        run_id: the job id (``--rdzv-id``).
        min_nodes, max_nodes: ``--nnodes``.
        join_timeout: seconds a round may wait for machines.
        hosting: whether this launcher hosts the rendezvous store.
        max_restarts: ``--max-restarts``, to say "restart 1 of 2".
        say: where lines go (the launcher's stderr by default).
        interval: seconds between waiting lines (default: :func:`report_interval`).
        last_call: seconds an elastic round waits for more machines once enough have joined
            (``--rdzv-conf last_call_timeout``; torch's default 30).
    """

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        join_timeout: float,
        hosting: bool,
        max_restarts: int = 0,
        say: Callable[[str], None] = say_on_stderr,
        interval: float | None = None,
        last_call: float = 30.0,
    ) -> None:
        self.endpoint = endpoint
        self.last_call = last_call
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.join_timeout = join_timeout
        self.hosting = hosting
        self.max_restarts = max_restarts
        self.say = say
        self.interval = report_interval() if interval is None else interval
        self.previous: RoundView | None = None
        self.last_waiting_view: RoundView | None = None  # what the reports saw last
        self.failure_restarts = 0

    # ---- while waiting -------------------------------------------------------------------
    @property
    def nnodes(self) -> str:
        if self.min_nodes == self.max_nodes:
            return str(self.max_nodes)
        return f"{self.min_nodes}:{self.max_nodes}"

    def _needed(self) -> str:
        if self.min_nodes == self.max_nodes:
            return str(self.max_nodes)
        return f"{self.min_nodes} (up to {self.max_nodes})"

    def strangers(self, visitors: list[Visitor], me: str) -> list[str]:
        """Launchers that reached the endpoint but cannot join this job, and why."""
        found = []
        for v in visitors:
            if v.key == me:
                continue
            if v.run_id != self.run_id:
                found.append(f"a launcher on {v.host} (pid {v.pid}) reached this endpoint with "
                              f"--rdzv-id {v.run_id} (this one: {self.run_id})")
            elif v.nnodes != self.nnodes:
                found.append(f"a launcher on {v.host} (pid {v.pid}) asked for --nnodes "
                              f"{v.nnodes} (this one: {self.nnodes})")
        return found

    def waiting_line(self, view: RoundView, visitors: list[Visitor], me: str,
                     waited_s: float) -> str:
        """``waiting for machines at 10.0.0.1:29400 (job train7): 1 of 2 joined ...``."""
        hosts = view.hosts()
        if self.min_nodes == self.max_nodes:
            joined = f"{len(hosts)} of {self.max_nodes} joined"
        else:
            joined = f"{len(hosts)} joined ({self.min_nodes} needed, up to {self.max_nodes})"
        if hosts:
            joined += f" ({', '.join(hosts)})"
        where = "hosted here" if self.hosting else "store reached"
        if self.min_nodes < self.max_nodes and len(hosts) >= self.min_nodes:
            # Enough have come: the round closes at its last call, not at the join timeout.
            ends = (f"starting with {_plural(len(hosts), 'machine')} {self.last_call:.0f} s "
                    "after the last one joined, unless more join (last_call_timeout)")
        else:
            ends = f"giving up at {self.join_timeout:.0f} s"
        line = (f"waiting for machines at {self.endpoint} (job {self.run_id}, {where}): {joined} "
                f"after {waited_s:.0f} s; {ends}")
        odd = self.strangers(visitors, me)
        return line + (". But " + "; ".join(odd) if odd else "")

    def timeout_message(self, view: RoundView, visitors: list[Visitor], me: str) -> str:
        """The join timeout's error: what was seen, and what to check.

        ``view`` is the state after the timeout, which no longer lists this launcher: the
        last view a waiting line saw is used when it saw more.
        """
        seen_last = self.last_waiting_view
        if seen_last is not None and len(seen_last.hosts()) > len(view.hosts()):
            view = seen_last
        hosts = view.hosts()
        seen = (f"{_plural(len(hosts), 'machine')} joined ({', '.join(hosts)})"
                if hosts else "no machine joined")
        others = [v for v in visitors if v.key != me]
        if others:
            reached = (f"{_plural(len(others), 'other launcher')} reached the endpoint "
                       f"({', '.join(sorted({v.host for v in others}))})")
        else:
            reached = "no other launcher reached the endpoint"
        odd = self.strangers(visitors, me)
        lines = [
            (f"no rendezvous at {self.endpoint} (job {self.run_id}) within "
             f"{self.join_timeout:.0f} s: {seen} of the {self._needed()} needed; {reached}."),
        ]
        if odd:
            lines.append("Mismatched: " + "; ".join(odd) + ".")
        lines.append(
            "Check on every machine: the same --rdzv-endpoint (an address of the first machine "
            "that the others can reach, not 127.0.0.1 across machines), the port open in the "
            f"firewall, the same --rdzv-id ({self.run_id}) and the same --nnodes "
            f"({self.nnodes}); and that every machine was started."
        )
        return "\n".join(lines)

    @contextlib.contextmanager
    def waiting(self, view: Callable[[], RoundView], visitors: Callable[[], list[Visitor]],
                me: str) -> Iterator[None]:
        """Print a waiting line every ``interval`` seconds while the block runs."""
        stop = threading.Event()
        start = time.monotonic()

        def report() -> None:
            while not stop.wait(self.interval):
                try:
                    now = view()
                    if now.hosts() or self.last_waiting_view is None:
                        # a view with nobody in it comes after this launcher withdrew at the
                        # timeout: the message keeps the last one that still listed it
                        self.last_waiting_view = now
                    line = self.waiting_line(now, visitors(), me, time.monotonic() - start)
                except Exception:  # a report must never break the rendezvous
                    logger.debug("could not read the rendezvous state", exc_info=True)
                    continue
                if not stop.is_set():
                    self.say(line)

        thread = threading.Thread(target=report, name="lockstep-rdzv-report", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=1.0)

    # ---- once a round is complete --------------------------------------------------------
    def announce(self, view: RoundView, evidence: dict[int, dict[str, Any]] | None = None,
                 failed: bool = False, stale_after: float = 10.0) -> list[str]:
        """Say who makes up the new round, and what changed since the last one.

        Args:
            view: the completed round.
            evidence: what this launcher's workers said of peers they lost, by global rank
                (``lockstep.diagnose.hang``'s blame records: ``host``, ``step``, ``state``).
            failed: whether this launcher's workers failed in the previous round (a restart
                that counts against ``--max-restarts``); otherwise the round is new because
                machines joined, left, or restarted their own workers.
            stale_after: seconds without heartbeat after which a launcher "stopped answering".
        """
        lines: list[str] = []
        ranges = rank_ranges(view.members)
        world = _world(view.members)
        before = self.previous
        machines = ", ".join(describe_machine(m, ranges) for m in view.members)
        if before is None:
            lines.append(f"{_plural(len(view.members), 'machine')} met at {self.endpoint} "
                         f"(job {self.run_id}): {machines}; world {world}")
        else:
            lines += self._changes(before, view, evidence or {}, stale_after)
            was = _world(before.members)
            if failed:
                self.failure_restarts += 1
                what = f"restart {self.failure_restarts} of {self.max_restarts}"
            elif len(lines) == 0:
                what = "new round (another machine restarted its workers)"
            else:
                what = "new round (membership changed)"
            change = f" (was {was})" if was != world else ""
            lines.append(f"{what} with {_plural(len(view.members), 'machine')}, world {world}"
                         f"{change}: {machines}")
        self.previous = view
        for line in lines:
            self.say(line)
        return lines

    def _changes(self, before: RoundView, after: RoundView,
                 evidence: dict[int, dict[str, Any]], stale_after: float) -> list[str]:
        old_ranges = rank_ranges(before.members)
        now = {m.key for m in after.members}
        lines = []
        for member in before.members:
            if member.key in now:
                continue
            first, last = old_ranges.get(member.key, (0, -1))
            told = [evidence[r] for r in range(first, last + 1) if r in evidence]
            step = max((int(t["step"]) for t in told if t.get("step") is not None), default=None)
            at = f" at step ~{step}" if step is not None else ""
            age = after.heartbeat_age.get(member.key)
            if age is None or age > stale_after:
                why = "its launcher stopped answering"
                if age is not None:
                    why += f" (no heartbeat for {age:.0f} s)"
            else:
                why = "its launcher did not join the new round"
            if told and told[0].get("state") == "gone":
                why += "; its workers fell silent mid-collective"
            elif told:
                why += f"; its workers were {told[0].get('state')} for their peers"
            lines.append(f"{describe_machine(member, old_ranges)} left{at}: {why}")
        was = {m.key for m in before.members}
        new_ranges = rank_ranges(after.members)
        for member in after.members:
            if member.key not in was:
                lines.append(f"{describe_machine(member, new_ranges)} joined")
        return lines
