"""Hang detection: a collective that a peer never joins fails, naming the op and the rank.

Without help, a rank that died or is stuck leaves every other rank waiting in its next
collective until the process group's timeout (10 minutes by default), and the error says
nothing about who was missing. :class:`CollectiveWatchdog` records, in the rendezvous store,
the last collective each rank entered; a collective that has not completed within ``timeout``
raises :class:`CollectiveTimeoutError` on every waiting rank, naming the ranks that never
arrived and where each of them last was. In debug mode (``LOCKSTEP_DEBUG_COLLECTIVES=1``) the
ranks also compare what they are about to call before calling it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose.collective_checks import (
    CollectiveMismatchError,
    debug_collectives_enabled,
    describe_mismatch,
    odd_ranks,
    signature,
)
from lockstep.diagnose.hang import CollectiveTimeoutError, write_blame
from lockstep.diagnose.progress import GroupProgress, default_store

__all__ = ["CollectiveTimeoutError", "CollectiveWatchdog"]

logger = logging.getLogger(__name__)

_PREFIX = "lockstep/watchdog"


class CollectiveWatchdog:
    """Run collectives that fail within ``timeout`` naming the rank that did not arrive.

    Every rank of the group makes the same calls in the same order. Each call costs one store
    write (two, plus a wait, in debug mode).

    Args:
        process_group: the group to watch (``None``: the default group).
        timeout: seconds (or a ``timedelta``) a collective may take before it is a hang.
        debug: compare every collective across ranks first; by default, on when the
            ``LOCKSTEP_DEBUG_COLLECTIVES`` environment variable is ``1``.
        name: tells apart several watchdogs on one group (their call counts differ).

    Example::

        watchdog = CollectiveWatchdog(timeout=60)
        watchdog.all_reduce(loss)   # a rank stuck elsewhere -> CollectiveTimeoutError naming it
    """

    def __init__(
        self,
        process_group: Any = None,
        timeout: float | timedelta = 300.0,
        *,
        debug: bool | None = None,
        name: str = "default",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "CollectiveWatchdog needs a process group: call lockstep.init_distributed() first"
            )
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if seconds <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.process_group = process_group
        self.timeout = timedelta(seconds=seconds)
        self.debug = debug_collectives_enabled() if debug is None else debug
        self._ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self._rank = dist.get_rank()
        self._store = default_store()
        self._group_key = f"{_PREFIX}/{name}/{'-'.join(map(str, self._ranks))}"
        self._seq = 0
        self._progress = GroupProgress(process_group)  # peers' errors say where this rank is

    # -- collectives ---------------------------------------------------------------------------

    # The three collectives below pass the timeout down to the backend as well, so that on
    # gloo the operation itself gives up: a process cannot exit while its group still runs one.

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        """``torch.distributed.all_reduce`` in place, watched."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, self.timeout
        self.run("all_reduce", [tensor], lambda: self._group().allreduce([tensor], opts))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``torch.distributed.broadcast`` from global rank ``src``, watched."""
        if src not in self._ranks:
            raise ValueError(f"broadcast src={src} is not a rank of this group: {self._ranks}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = self._ranks.index(src), 0, self.timeout
        self.run(f"broadcast(src={src})", [tensor], lambda: self._group().broadcast([tensor], opts))

    def barrier(self) -> None:
        """``torch.distributed.barrier``, watched."""
        opts = dist.BarrierOptions()
        opts.timeout = self.timeout
        self.run("barrier", [], lambda: self._group().barrier(opts))

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def run(self, name: str, tensors: Sequence[torch.Tensor], launch: Callable[[], Any]) -> None:
        """Start a collective with ``launch()`` (which returns its ``Work``) and wait, watched.

        The collective you launch keeps waiting in the backend up to the process group's own
        timeout (``lockstep.init_distributed(timeout=...)``), which bounds how long a failed
        process takes to exit.

        Raises:
            CollectiveTimeoutError: it did not complete within the timeout; names missing ranks.
            CollectiveMismatchError: (debug mode) ranks were about to call different things.
        """
        self._seq += 1
        op = f"{name} #{self._seq}"
        self._announce(op)
        self._progress.enter(f"watchdog {op}")
        if self.debug:
            self._compare(op, signature(name, tensors))
        work = launch()
        if work is None:
            return
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise self._diagnose(op, exc) from exc

    # -- store bookkeeping ---------------------------------------------------------------------

    def _announce(self, op: str) -> None:
        """Record ``op`` as this rank's latest collective (one key per rank, overwritten)."""
        if self._store is not None:
            self._store.set(f"{self._group_key}/last/{self._rank}", f"{self._seq}|{op}")

    def _last_seen(self) -> dict[int, tuple[int, str]]:
        seen: dict[int, tuple[int, str]] = {}
        for rank in self._ranks:
            key = f"{self._group_key}/last/{rank}"
            if self._store.check([key]):
                seq, _, op = self._store.get(key).decode().partition("|")
                seen[rank] = (int(seq), op)
        return seen

    def _diagnose(self, op: str, cause: Exception) -> Exception:
        waited = f"{self.timeout.total_seconds():g}s"
        try:
            seen = self._last_seen() if self._store is not None else None
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be the one that died
            seen = None
        if seen is None:
            return CollectiveTimeoutError(
                f"rank {self._rank}: {op} did not complete within {waited} and the rendezvous "
                f"store (hosted by rank {self._ranks[0]}) cannot say who is missing; rank "
                f"{self._ranks[0]} probably died. Cause: {cause}", op, [],
            )
        missing = [r for r in self._ranks if seen.get(r, (0, ""))[0] < self._seq]
        if not missing:
            return CollectiveTimeoutError(
                f"rank {self._rank}: every rank entered {op}, but it failed: {cause}", op, []
            )
        where = "; ".join(
            f"rank {r} last entered {seen[r][1]}" if r in seen
            else f"rank {r} entered no watched collective"
            for r in missing
        )
        message = (
            f"rank {self._rank}: {op} did not complete within {waited}: rank(s) {missing} did not "
            f"arrive ({where}). Look at those ranks' logs: they died, hang, or skipped this "
            "collective; if they are only slow (a loader stall, an evaluation on one rank), "
            "raise CollectiveWatchdog(timeout=...)."
        )
        write_blame(self._rank, [{"rank": r, "state": "stuck"} for r in missing], message)
        return CollectiveTimeoutError(message, op, missing)

    def _compare(self, op: str, mine: str) -> None:
        """Debug mode: publish this rank's signature, wait for all, raise if any differs."""
        if self._store is None:
            return
        keys = [f"{self._group_key}/sig/{self._seq}/{r}" for r in self._ranks]
        self._store.set(keys[self._ranks.index(self._rank)], mine)
        try:
            self._store.wait(keys, self.timeout)
        except Exception as exc:
            raise self._diagnose(op, exc) from exc
        signatures = [self._store.get(key).decode() for key in keys]
        if self._seq > 2:
            # Everyone has published #seq, so everyone is done reading #seq-2.
            self._store.delete_key(f"{self._group_key}/sig/{self._seq - 2}/{self._rank}")
        message = describe_mismatch(signatures, self._ranks)
        if message is not None:
            odd = odd_ranks(signatures, self._ranks)
            write_blame(self._rank, [{"rank": r, "state": "mismatch"} for r in odd], message)
            raise CollectiveMismatchError(f"before {op}: {message}", odd)
