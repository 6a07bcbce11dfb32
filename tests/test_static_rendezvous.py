"""The static rendezvous's orderly departure: machine 0 keeps the store until the others left.

The race it closes (machine 0's launcher exiting while another is in torch's exit barrier) is
exercised end to end by test_multimachine's static pair; these tests pin the logic on a real
store in one process, with no timing asserted beyond "it returned".
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from lockstep.cli import build_parser
from lockstep.launcher import config
from lockstep.launcher.launch_plan import to_launch_config
from lockstep.launcher.rendezvous import register_backends
from lockstep.launcher.static_rendezvous import (
    DEPARTED_KEY,
    STATIC_BACKEND,
    OrderlyStaticRendezvous,
)


class _Inner:
    """A stand-in for torch's handler that records what was forwarded to it."""

    use_agent_store = True

    def __init__(self, store):
        self.store = store
        self.calls: list[str] = []

    def next_rendezvous(self):
        self.calls.append("next_rendezvous")
        return type("Info", (), {"store": self.store, "rank": 0, "world_size": 2})()

    def shutdown(self):
        self.calls.append("shutdown")
        return True

    def is_closed(self):
        return False

    def set_closed(self):
        self.calls.append("set_closed")

    def num_nodes_waiting(self):
        return 0

    def get_run_id(self):
        return "job"


def _store():
    return dist.HashStore()


def test_host_waits_for_every_machine_to_leave():
    store = _store()
    host = OrderlyStaticRendezvous(_Inner(store), rank=0, world_size=3, wait_s=30)
    others = [OrderlyStaticRendezvous(_Inner(store), rank=r, world_size=3) for r in (1, 2)]
    for handler in (host, *others):
        handler.next_rendezvous()
    done = threading.Event()
    result: list[int] = []

    def host_leaves():
        result.append(host.leave(store))
        done.set()

    thread = threading.Thread(target=host_leaves)
    thread.start()
    assert not done.wait(0.3), "the host left while two machines were still in"
    assert others[0].shutdown() is True  # a non-host counts itself out and returns at once
    assert not done.wait(0.3), "the host left while one machine was still in"
    others[1].shutdown()
    assert done.wait(10), "the host kept waiting after every machine had left"
    thread.join()
    assert result == [3]
    assert store.add(DEPARTED_KEY, 0) == 3


def test_host_wait_is_bounded_when_a_machine_died():
    store = _store()
    host = OrderlyStaticRendezvous(_Inner(store), rank=0, world_size=2, wait_s=0.2)
    host.next_rendezvous()
    assert host.leave(store) == 1  # machine 1 never counts itself out: the wait ends anyway


def test_shutdown_before_meeting_and_a_vanished_store_do_not_raise():
    inner = _Inner(_store())
    handler = OrderlyStaticRendezvous(inner, rank=0, world_size=2, wait_s=0)
    assert handler.shutdown() is True  # never met: nothing to count out of
    assert inner.calls == ["shutdown"]

    class Gone:
        def add(self, key, value):
            raise RuntimeError("Connection reset by peer")

    assert handler.leave(Gone()) == 0


def test_everything_else_is_torchs_handler():
    inner = _Inner(_store())
    handler = OrderlyStaticRendezvous(inner, rank=1, world_size=2)
    info = handler.next_rendezvous()
    assert info.store is inner.store
    handler.set_closed()
    assert (handler.use_agent_store, handler.is_closed(), handler.num_nodes_waiting(),
            handler.get_run_id(), handler.get_backend()) == (True, False, 0, "job", STATIC_BACKEND)
    assert inner.calls == ["next_rendezvous", "set_closed"]
    with pytest.raises(ValueError, match="wait_s must be >= 0"):
        OrderlyStaticRendezvous(inner, rank=0, world_size=2, wait_s=-1)


def test_static_plans_launch_on_the_orderly_handler(tmp_path):
    """``--rdzv-backend static`` stays ``static`` in the plan (what the user asked for) and
    becomes lockstep's handler in the launch config; the registry builds it from torch's."""
    args = build_parser().parse_args([
        "run", "--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1",
        "--master-port", "29511", "--no-python", "/bin/true"])
    plan = config.plan_from_args(args, environ={})
    assert plan.rdzv_backend == "static"
    launch = to_launch_config(plan, str(tmp_path))
    assert launch.rdzv_backend == STATIC_BACKEND
    register_backends()
    params = RendezvousParameters(STATIC_BACKEND, "127.0.0.1:29511", "job", 2, 2, rank=1,
                                  timeout=timedelta(seconds=5).seconds)
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, OrderlyStaticRendezvous)
    assert (handler.rank, handler.world_size, handler.use_agent_store) == (1, 2, True)
    assert handler.get_run_id() == "job"


def test_the_workers_meet_where_the_user_said():
    """torch's agent gives workers ``bootstrap_store_info`` as MASTER_ADDR/MASTER_PORT when the
    backend is not named ``static`` (torch 2.4 to 2.13): it must be --master-addr/--master-port,
    and the workers use the launcher's store (``use_agent_store``), as with torch's own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    register_backends()
    params = RendezvousParameters(STATIC_BACKEND, f"127.0.0.1:{port}", "job", 1, 1, rank=0,
                                  timeout=30)
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        "127.0.0.1", port)
    assert (info.rank, info.world_size, handler.use_agent_store) == (0, 1, True)
    assert handler.shutdown() is True
    assert info.store.add(DEPARTED_KEY, 0) == 1  # it counted itself out, in the job's store


def test_static_on_loopback_keeps_gloo_on_loopback():
    """--master-addr 127.0.0.1 is one machine: gloo's sockets stay on loopback, as with the
    default rendezvous (until 2026-11-29 they listened on the host name's address)."""
    import socket

    if "lo" not in {name for _, name in socket.if_nameindex()}:
        pytest.skip("no loopback interface named lo")
    local = build_parser().parse_args([
        "run", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", "29511",
        "--no-python", "/bin/true"])
    assert config.plan_from_args(local, environ={}).worker_env["GLOO_SOCKET_IFNAME"] == "lo"
    remote = build_parser().parse_args([
        "run", "--rdzv-backend", "static", "--master-addr", "10.0.0.1", "--master-port", "29511",
        "--nnodes", "2", "--no-python", "/bin/true"])
    assert "GLOO_SOCKET_IFNAME" not in config.plan_from_args(remote, environ={}).worker_env
