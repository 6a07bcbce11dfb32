"""Who is in the world: the store keys survivors and replacements meet through.

A *slot* is a rank of the job as launched (``RANK``, ``0..WORLD_SIZE-1``); a *generation* is
one membership of the world, numbered from 0 (every slot). Each generation gets its own process
group, made from the job's store under the prefix ``g<N>/pg/``; a member's rank in it is its
place among the generation's slots, in order.

Keys (under :data:`PREFIX` of the launcher's store, see :func:`job_store`):

- ``g<N>/alive/<slot>``: a member's answer to the roll call after generation N failed:
  ``"<pid>,<step>,<kind>"`` (``kind``: ``comm`` for a failed collective, ``local`` for any
  other error);
- ``dead/<slot>/<pid>`` (:func:`dead_key`): written by a launcher when a worker process dies,
  or when the machine it ran on is lost, so that survivors need not wait out a timeout to know
  who is gone (the slot makes it unique across machines, whose pids may repeat);
- ``spare/<node>/<pid>`` (:func:`spare_key`): the slot a warm spare of machine ``node`` is to
  take, ``"<slot>,<local rank>"``;
- ``loss/<n>``: the machine of the n-th loss a launcher counted (``losses``: how many so far),
  so that survivors blocked on a machine that vanished without closing its connections stop
  waiting (see :mod:`lockstep.resilience.losses`);
- ``join/<slot>``: a replacement's pid, asking for the slot;
- ``g<N>/next``: the proposal that ends generation N (the first written wins:
  ``compare_set``), a :class:`Proposal`;
- ``admitted/<slot>/<pid>``: the generation a replacement was admitted to;
- ``g<N>/admit/<step>``: the first member's decision at an admission boundary (a proposal, or
  ``none``);
- ``done``: the job finished (a waiting replacement then exits).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PREFIX", "Member", "Proposal", "dead_key", "job_store", "propose", "spare_key",
           "wait_until"]

PREFIX = "lockstep/survivors"


def job_store(store: Any) -> Any:
    """The survivors' keys inside the launcher's ``store`` (a ``torch.distributed.Store``)."""
    import torch.distributed as dist

    return dist.PrefixStore(PREFIX, store)


def dead_key(slot: int, pid: int) -> str:
    """The key a launcher sets when process ``pid`` holding ``slot`` is gone."""
    return f"dead/{slot}/{pid}"


def spare_key(node: int, pid: int) -> str:
    """The key that names the slot a warm spare (process ``pid`` of machine ``node``) takes."""
    return f"spare/{node}/{pid}"


@dataclass(frozen=True)
class Member:
    """One process in a generation: its slot and pid, and the steps it has completed."""

    slot: int
    pid: int
    step: int = 0


@dataclass(frozen=True)
class Proposal:
    """The next generation: its members (by slot, ascending), and whose state they all take."""

    generation: int
    members: tuple[Member, ...]
    source: int  # the slot whose state every member loads
    step: int  # the step the generation starts at (the source's)

    @property
    def slots(self) -> list[int]:
        return [m.slot for m in self.members]

    def rank_of(self, slot: int) -> int:
        return self.slots.index(slot)

    def encode(self) -> str:
        members = ";".join(f"{m.slot},{m.pid},{m.step}" for m in self.members)
        return f"{self.generation}|{members}|{self.source}|{self.step}"

    @classmethod
    def decode(cls, text: str) -> Proposal:
        generation, members, source, step = text.split("|")
        parsed = tuple(Member(*(int(v) for v in m.split(","))) for m in members.split(";"))
        return cls(int(generation), parsed, int(source), int(step))


def propose(generation: int, alive: Sequence[Member], joining: Sequence[Member]) -> Proposal:
    """Generation ``generation``: ``alive`` members and ``joining`` replacements, slots in order.

    Every member takes the state of the alive member that completed the most steps (the first
    slot among equals): a member whose last collective failed may have missed the step that
    another member finished, and a replacement has none (its step is -1 in the proposal).
    """
    if not alive:
        raise ValueError("a new generation needs at least one surviving member")
    source = min(alive, key=lambda m: (-m.step, m.slot))
    members = tuple(sorted([*alive, *(Member(j.slot, j.pid, -1) for j in joining)],
                           key=lambda m: m.slot))
    slots = [m.slot for m in members]
    if len(set(slots)) != len(slots):
        raise ValueError(f"two processes claim one slot in {slots}")
    return Proposal(generation, members, source.slot, source.step)


def wait_until(ready: Callable[[], Any], timeout: float, what: str, poll: float = 0.01) -> Any:
    """Poll ``ready()`` until it returns something other than None; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"lockstep.Survivors: waited {timeout:.0f} s for {what}")
        time.sleep(poll)
