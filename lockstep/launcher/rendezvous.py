"""lockstep's rendezvous: torch's c10d rendezvous, restart-safe, and on loopback for one machine.

Both backends are torch.distributed.elastic's ``DynamicRendezvousHandler`` over its
``C10dRendezvousBackend``, registered in torch's rendezvous registry, with two changes:

- Restarts work: the workers' bootstrap store is recreated before every round (see
  :class:`FreshStoreRendezvousHandler`).
- ``lockstep-loopback`` (endpoints on 127.0.0.1/localhost): torch's ``TCPStore`` servers
  listen on every network interface, even for ``localhost:0``, so anyone who can reach the
  machine could read or write the job's rendezvous state. Here lockstep binds the listening
  socket to 127.0.0.1 itself and hands it to the store (``master_listen_fd``). Several agents
  on one machine (``--nnodes 2`` on loopback) share it: the first binds the port and hosts the
  store, the others connect.
- ``lockstep-c10d`` (any other endpoint): torch's stores, reachable by the other machines.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
    create_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = [
    "C10D_BACKEND",
    "LOOPBACK_BACKEND",
    "LOOPBACK_HOST",
    "FreshStoreRendezvousHandler",
    "LoopbackRendezvousHandler",
    "is_loopback_host",
    "loopback_store",
    "register_backends",
]

logger = logging.getLogger(__name__)

LOOPBACK_BACKEND = "lockstep-loopback"
C10D_BACKEND = "lockstep-c10d"
LOOPBACK_HOST = "127.0.0.1"
_LISTEN_BACKLOG = 512  # every worker and agent of the job may connect at once
# torch's libuv store serves a listening socket handed to it only from 2.8 on
# (pytorch/pytorch#150215); older versions need the classic store for that.
_LIBUV_TAKES_LISTEN_FD = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.x.y.z``, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_loopback(port: int) -> socket.socket | None:
    """A listening socket on 127.0.0.1:``port``, or None when another agent already has it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Lets a fixed --rdzv-endpoint port be reused right after the previous job ended.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK_HOST, port))
        sock.listen(_LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE and port != 0:
            return None
        raise RuntimeError(
            f"cannot listen on {LOOPBACK_HOST}:{port} for the rendezvous: {exc}"
        ) from exc
    return sock


def loopback_store(port: int, timeout: timedelta, host: bool | None = None) -> dist.TCPStore:
    """A multi-tenant ``TCPStore`` on 127.0.0.1:``port``, hosted here unless another process is.

    Args:
        port: the port; 0 picks a free one (and always hosts).
        timeout: how long store operations wait.
        host: force hosting (True) or connecting (False); by default host if the port is free.
    """
    sock = _bind_loopback(port) if host is not False else None
    if sock is None:
        if host:
            raise RuntimeError(f"{LOOPBACK_HOST}:{port} is taken; cannot host the rendezvous store")
        return dist.TCPStore(
            LOOPBACK_HOST, port, is_master=False, timeout=timeout, multi_tenant=True
        )
    bound_port = sock.getsockname()[1]
    # The store takes ownership of the descriptor, so Python must not close it.
    return dist.TCPStore(
        LOOPBACK_HOST,
        bound_port,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        use_libuv=_LIBUV_TAKES_LISTEN_FD,
    )


class FreshStoreRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, with a new store for the workers of every attempt.

    Recent torch (2.13 checked) has the rank-0 agent host a store for its workers'
    ``init_process_group`` (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it across restarts,
    while workers no longer prefix their keys by attempt: after a restart, gloo reads the
    previous attempt's addresses and fails to connect (torchrun's ``--max-restarts`` breaks
    the same way). Forgetting the store before each round makes rank 0 host a fresh one;
    on torch versions without these attributes, setting them changes nothing.
    """

    def next_rendezvous(self):
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None
        return super().next_rendezvous()

    def get_backend(self) -> str:
        """The registry checks that a handler serves the backend it was asked for."""
        return C10D_BACKEND


class LoopbackRendezvousHandler(FreshStoreRendezvousHandler):
    """The same, with the workers' store on 127.0.0.1 (torch's listens on every interface)."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
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


def create_loopback_handler(params: RendezvousParameters) -> LoopbackRendezvousHandler:
    """Build the loopback handler from launcher parameters (the registry's creator)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if not is_loopback_host(host):
        raise ValueError(
            f"the {LOOPBACK_BACKEND} rendezvous serves loopback endpoints only, got {host!r}; "
            f"use the {C10D_BACKEND} rendezvous for a multi-machine endpoint"
        )
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(port, read_timeout, params.get_as_bool("is_host"))
    backend = C10dRendezvousBackend(store, params.run_id)
    return LoopbackRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr or LOOPBACK_HOST,
        timeout=_rendezvous_timeout(params),
    )


def create_c10d_handler(params: RendezvousParameters) -> FreshStoreRendezvousHandler:
    """torch's c10d rendezvous (stores reachable by other machines), restart-safe."""
    backend, store = create_backend(params)
    return FreshStoreRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr,
        timeout=_rendezvous_timeout(params),
    )


def register_backends() -> None:
    """Make lockstep's two backends known to torch's rendezvous registry.

    The registry is torch's extension point for rendezvous backends; registering the same
    creator again is a no-op.
    """
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, create_loopback_handler)
    rendezvous_handler_registry.register(C10D_BACKEND, create_c10d_handler)
