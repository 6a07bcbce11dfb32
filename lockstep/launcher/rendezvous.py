"""lockstep's rendezvous: torch's c10d rendezvous, restart-safe, and on loopback for one machine.

Both backends are torch.distributed.elastic's ``DynamicRendezvousHandler`` over its
``C10dRendezvousBackend``, registered in torch's rendezvous registry, with these changes:

- Restarts work: the workers' bootstrap store is recreated before every round (see
  :class:`FreshStoreRendezvousHandler`).
- ``lockstep-loopback`` (endpoints on 127.0.0.1/localhost): every store listens on 127.0.0.1
  only; ``lockstep-c10d`` (any other endpoint): the launcher on the machine that owns the
  address hosts the store (see :mod:`~lockstep.launcher.stores`).
- Both talk (:mod:`~lockstep.launcher.rendezvous_report`): a line every few seconds while waiting, a
  timeout that says what was seen, and the machines that joined or left at each round.
- ``lockstep-static`` is torch's static rendezvous (``--rdzv-backend static``), wrapped so that
  its host leaves last too (:mod:`~lockstep.launcher.static_rendezvous`).
- The store's host leaves last: at shutdown every launcher counts itself out and the host
  waits for them (briefly), so that no launcher's last words meet a store that is gone (a C++
  stack trace and "failed to shutdown the rendezvous" after a good job).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from lockstep._torch_compat import (
    WorkersStoreOverride,
    forget_shared_store_server,
    rendezvous_internals,
)
from lockstep.launcher.rendezvous_report import Meeting, Member, RoundView, Visitor, say_on_stderr
from lockstep.launcher.static_rendezvous import STATIC_BACKEND, create_static_handler
from lockstep.launcher.stores import (
    LOOPBACK_HOST,
    endpoint_store,
    is_loopback_host,
    loopback_store,
    open_loopback_store,
)

__all__ = [
    "C10D_BACKEND",
    "LOOPBACK_BACKEND",
    "LOOPBACK_HOST",
    "STATIC_BACKEND",
    "FreshStoreRendezvousHandler",
    "LoopbackRendezvousHandler",
    "endpoint_store",
    "is_loopback_host",
    "loopback_store",
    "open_loopback_store",
    "register_backends",
]

logger = logging.getLogger(__name__)

LOOPBACK_BACKEND = "lockstep-loopback"
C10D_BACKEND = "lockstep-c10d"
_VISITORS_KEY = "lockstep/rdzv/visitors"  # every launcher that reached the store, any job
_STALE_HEARTBEATS = 3  # keep-alive intervals without a heartbeat: "stopped answering"
_DEPARTED_KEY = "lockstep/rdzv/departed"  # launchers that left, whatever their job
_DEPARTURE_WAIT_S = 10.0  # how long the store's host waits for the others to leave
_HOST_KEY = "lockstep/rdzv/host"  # the launcher that hosts the store: its job, host and pid


def lost_members(participants: Any, last_heartbeats: Any, now: datetime, stale_after: float,
                 me: str, closed: bool) -> list[str]:
    """The participants (other than ``me``) with no heartbeat for more than ``stale_after``
    seconds. None once the rendezvous is closed: a launcher that ended, well or not, closes it
    (its heartbeat stops too), and the others are then finishing, not waiting."""
    if closed:
        return []
    return [repr(node) for node in participants if repr(node) != me
            and node in last_heartbeats
            and (now - last_heartbeats[node]).total_seconds() > stale_after]


class FreshStoreRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, with a new store for the workers of every attempt.

    Recent torch (2.13 checked) has the rank-0 agent host a store for its workers'
    ``init_process_group`` (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it across restarts,
    while workers no longer prefix their keys by attempt: after a restart, gloo reads the
    previous attempt's addresses and fails to connect (torchrun's ``--max-restarts`` breaks
    the same way). Forgetting the store before each round makes rank 0 host a fresh one
    (:func:`~lockstep._torch_compat.forget_shared_store_server`; a no-op on a torch that keeps
    no store). The handler's private members are read through
    :func:`~lockstep._torch_compat.rendezvous_internals`.

    With a :class:`~lockstep.launcher.rendezvous_report.Meeting` attached (:meth:`attach`), it also
    reports while waiting and at each round, and orders its shutdown (see the module).
    """

    meeting: Meeting | None = None
    hosts_store: bool = False
    _warned_foreign_host: bool = False
    log_dir: str | None = None
    # The agent restarts its workers for one of two reasons: they failed, or it asked
    # num_nodes_waiting() and machines were waiting to join. Remembering the second tells
    # them apart, even for a worker killed by a signal that left no error file.
    _saw_waiting: bool = False

    def num_nodes_waiting(self) -> int:
        waiting = super().num_nodes_waiting()
        if waiting == 0 and self._lost_members():
            # A machine of this round died (its launcher stopped answering) while this one's
            # workers wait for its workers, e.g. in init_process_group: nothing fails here,
            # so restart them and meet again without it, as for a machine that waits to join.
            waiting = 1
        if waiting > 0:
            self._saw_waiting = True
        return waiting

    def _lost_members(self) -> list[str]:
        """The members of this round whose launcher stopped answering (state as just synced)."""
        try:
            torch_side = rendezvous_internals(self)
        except RuntimeError:
            return []
        stale = self.settings.keep_alive_interval.total_seconds() * _STALE_HEARTBEATS
        state = torch_side.state
        return lost_members(state.participants, state.last_heartbeats, datetime.now(timezone.utc),
                            stale, repr(torch_side.this_node), bool(state.closed))

    def attach(self, meeting: Meeting, nproc: int, log_dir: str | None) -> None:
        """Report through ``meeting``; publish this launcher's worker count and visit."""
        self.meeting, self.log_dir = meeting, log_dir
        torch_side = rendezvous_internals(self)
        me, store = torch_side.this_node, torch_side.store
        record = {"nproc": nproc, "host": socket.gethostname()}
        store.set(self._nproc_key(repr(me)), json.dumps(record))
        visit = {"key": repr(me), "host": record["host"], "pid": me.pid,
                 "run_id": self.settings.run_id, "nnodes": meeting.nnodes}
        store.append(_VISITORS_KEY, json.dumps(visit) + "\n")
        if self.hosts_store:
            store.set(_HOST_KEY, json.dumps({k: visit[k] for k in ("run_id", "host", "pid")}))
        self._warned_foreign_host = False

    def _nproc_key(self, node: str) -> str:
        return f"lockstep/{self.settings.run_id}/nproc/{node}"

    def _rdzv_store(self) -> Any:
        return rendezvous_internals(self).store

    def _this_node_key(self) -> str:
        return repr(rendezvous_internals(self).this_node)

    # ---- what the reports read -----------------------------------------------------------
    def round_view(self) -> RoundView:
        """A plain snapshot of the rendezvous state this launcher last synced."""
        state = rendezvous_internals(self).state
        now = datetime.now(timezone.utc)
        records = self._records([repr(n) for n in [*state.participants, *state.wait_list]])

        def member(node: Any, rank: int) -> Member:
            record = records.get(repr(node), {})
            return Member(repr(node), record.get("host", node.addr), rank, record.get("nproc"))

        members = tuple(member(n, r) for n, r in sorted(state.participants.items(),
                                                          key=lambda item: item[1]))
        waiting = tuple(member(n, -1) for n in state.wait_list)
        ages = {repr(n): (now - t).total_seconds() for n, t in state.last_heartbeats.items()}
        return RoundView(state.round, state.complete, members, waiting, ages)

    def _records(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """What each launcher published of itself (host name, worker count)."""
        found = {}
        store = self._rdzv_store()
        for node in nodes:
            key = self._nproc_key(node)
            if store.check([key]):
                found[node] = json.loads(store.get(key))
        return found

    def visitors(self) -> list[Visitor]:
        store = self._rdzv_store()
        if not store.check([_VISITORS_KEY]):
            return []
        found = []
        for line in store.get(_VISITORS_KEY).decode().splitlines():
            try:
                v = json.loads(line)
                found.append(Visitor(v["key"], v["host"], int(v["pid"]), v["run_id"], v["nnodes"]))
            except (ValueError, KeyError, TypeError):
                continue
        return found

    # ---- the rendezvous ------------------------------------------------------------------
    def next_rendezvous(self):
        forget_shared_store_server(self)
        meeting = self.meeting
        if meeting is None:
            return super().next_rendezvous()
        me = self._this_node_key()
        try:
            with meeting.waiting(self.round_view, self.visitors, me):
                info = super().next_rendezvous()
        except RendezvousTimeoutError as err:
            raise RendezvousTimeoutError(
                meeting.timeout_message(self.round_view(), self.visitors(), me)
            ) from err
        self._announce(meeting)
        return info

    def _announce(self, meeting: Meeting) -> None:
        from lockstep.launcher.errors import attempt_evidence

        evidence, _ = attempt_evidence(self.log_dir)
        failed_here = meeting.previous is not None and not self._saw_waiting
        self._saw_waiting = False
        view = self.round_view()
        stale = self.settings.keep_alive_interval.total_seconds() * _STALE_HEARTBEATS
        try:
            meeting.announce(view, evidence, failed=failed_here, stale_after=stale)
            self._warn_of_foreign_host(meeting)
        except Exception:
            logger.debug("could not announce the round", exc_info=True)

    def _warn_of_foreign_host(self, meeting: Meeting) -> None:
        """Say once when another job's launcher hosts the store: it closes it at its end."""
        store = self._rdzv_store()
        if self.hosts_store or self._warned_foreign_host or not store.check([_HOST_KEY]):
            return
        host = json.loads(store.get(_HOST_KEY))
        if host.get("run_id") == self.settings.run_id:
            return
        self._warned_foreign_host = True
        meeting.say(
            f"note: the rendezvous store at {meeting.endpoint} is hosted by the launcher of "
            f"another job (--rdzv-id {host.get('run_id')}, on {host.get('host')}, pid "
            f"{host.get('pid')}); when that job ends its launcher closes the store and this "
            "job stops with it. Give each job its own port in --rdzv-endpoint."
        )

    def shutdown(self) -> bool:
        done = super().shutdown()
        if self.meeting is not None:
            self._leave_in_order()
        return done

    def _leave_in_order(self) -> None:
        """Count this launcher out; the store's host waits until the others are out too.

        "The others": this job's launchers still in the rendezvous, and launchers of other
        jobs (another ``--rdzv-id`` or ``--nnodes``) that reached this store, which would
        otherwise meet a vanished store on their way out. One that died never counts itself
        out, so the wait is bounded.
        """
        try:
            store = self._rdzv_store()
            left = store.add(_DEPARTED_KEY, 1)
            if not self.hosts_store or self.meeting is None:
                return
            state = rendezvous_internals(self).state
            ours = {repr(n) for n in [*state.participants, *state.wait_list]}
            ours.add(self._this_node_key())
            strangers = self.meeting.strangers(self.visitors(), self._this_node_key())
            expected = len(ours) + len(strangers)
            deadline = time.monotonic() + _DEPARTURE_WAIT_S
            while left < expected and time.monotonic() < deadline:
                time.sleep(0.05)
                left = store.add(_DEPARTED_KEY, 0)
            if left < expected and strangers:
                self.meeting.say(
                    f"closing the rendezvous store at {self.meeting.endpoint}, which launchers "
                    f"of other jobs may still use ({'; '.join(strangers)}): they stop with it. "
                    "Give each job its own port in --rdzv-endpoint."
                )
        except Exception:
            logger.debug("orderly departure failed", exc_info=True)

    def get_backend(self) -> str:
        """The registry checks that a handler serves the backend it was asked for."""
        return C10D_BACKEND


class LoopbackRendezvousHandler(WorkersStoreOverride, FreshStoreRendezvousHandler):
    """The same, with the workers' store on 127.0.0.1 (torch's listens on every interface)."""

    def workers_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store(master_port, timeout=timedelta(seconds=300), host=True)

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    seconds = params.get_as_int(f"{key}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def _rendezvous_timeout(params: RendezvousParameters) -> RendezvousTimeout:
    join = _timeout(params, "join") or timedelta(seconds=params.get_as_int("timeout", 600) or 600)
    return RendezvousTimeout(
        join,
        _timeout(params, "last_call"),
        _timeout(params, "close"),
        _timeout(params, "heartbeat"),
    )


def _keep_alive(params: RendezvousParameters) -> dict[str, Any]:
    """``keep_alive_interval`` / ``keep_alive_max_attempt`` from ``--rdzv-conf``, if given."""
    found: dict[str, Any] = {}
    interval = params.get_as_int("keep_alive_interval")
    if interval is not None:
        found["keep_alive_interval"] = interval
    attempts = params.get_as_int("keep_alive_max_attempt")
    if attempts is not None:
        found["keep_alive_max_attempt"] = attempts
    return found


def _meeting(params: RendezvousParameters, hosting: bool) -> Meeting | None:
    """The reporter for a launch that asked for one (``lockstep run`` sets ``lockstep_nproc``)."""
    if params.get("lockstep_nproc") is None:
        return None
    return Meeting(
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=_rendezvous_timeout(params).join.total_seconds(),
        last_call=_rendezvous_timeout(params).last_call.total_seconds(),
        hosting=hosting,
        max_restarts=params.get_as_int("lockstep_max_restarts", 0) or 0,
        say=say_on_stderr,
    )


def _handler(cls: type[FreshStoreRendezvousHandler], params: RendezvousParameters, store: Any, hosting: bool,
             local_addr: str | None) -> Any:
    handler = cls.from_backend(
        params.run_id,
        store,
        C10dRendezvousBackend(store, params.run_id),
        params.min_nodes,
        params.max_nodes,
        local_addr=local_addr,
        timeout=_rendezvous_timeout(params),
        **_keep_alive(params),
    )
    handler.hosts_store = hosting
    meeting = _meeting(params, hosting)
    if meeting is not None:
        handler.attach(meeting, int(params.get("lockstep_nproc")), params.get("lockstep_log_dir"))
    return handler


def create_loopback_handler(params: RendezvousParameters) -> LoopbackRendezvousHandler:
    """Build the loopback handler from launcher parameters (the registry's creator)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if not is_loopback_host(host):
        raise ValueError(
            f"the {LOOPBACK_BACKEND} rendezvous serves loopback endpoints only, got {host!r}; "
            f"use the {C10D_BACKEND} rendezvous for a multi-machine endpoint"
        )
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    deadline = time.monotonic() + _rendezvous_timeout(params).join.total_seconds()
    store, hosting = open_loopback_store(port, read_timeout, params.get_as_bool("is_host"),
                                         _meeting(params, hosting=False), deadline)
    return _handler(LoopbackRendezvousHandler, params, store, hosting,
                    params.local_addr or LOOPBACK_HOST)


def create_c10d_handler(params: RendezvousParameters) -> FreshStoreRendezvousHandler:
    """The c10d rendezvous at a multi-machine endpoint, hosted by the machine that owns it."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    report = _meeting(params, hosting=False)
    deadline = time.monotonic() + _rendezvous_timeout(params).join.total_seconds()
    store, hosting = endpoint_store(host, port, read_timeout, params.get_as_bool("is_host"),
                                    report, deadline)
    return _handler(FreshStoreRendezvousHandler, params, store, hosting, params.local_addr)


def register_backends() -> None:
    """Make lockstep's three backends known to torch's rendezvous registry.

    The registry is torch's extension point for rendezvous backends; registering the same
    creator again is a no-op.
    """
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, create_loopback_handler)
    rendezvous_handler_registry.register(C10D_BACKEND, create_c10d_handler)
    rendezvous_handler_registry.register(STATIC_BACKEND, create_static_handler)
