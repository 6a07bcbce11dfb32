"""The stores machines meet through: on loopback for one machine, at the endpoint for several.

- :func:`loopback_store`: torch's ``TCPStore`` servers listen on every network interface, even
  for ``localhost:0``; this one binds 127.0.0.1 itself and hands the socket to the store
  (``master_listen_fd``). Several launchers on one machine share it: the first binds the port
  and hosts, the others connect.
- :func:`endpoint_store`: a multi-machine endpoint is hosted by the launcher on the machine
  that owns its address, found by binding it (torch compares host names, and misses a
  secondary interface: then nobody hosts and every launcher waits ten minutes in silence).
  The others connect once the port answers, saying every few seconds why it does not yet.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from lockstep.launcher.rendezvous_report import Meeting

__all__ = [
    "LOOPBACK_HOST",
    "endpoint_store",
    "is_loopback_host",
    "loopback_store",
    "open_loopback_store",
]

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
    return open_loopback_store(port, timeout, host)[0]


def open_loopback_store(
    port: int, timeout: timedelta, host: bool | None = None, report: Meeting | None = None,
    deadline: float | None = None,
) -> tuple[dist.TCPStore, bool]:
    """:func:`loopback_store`, and whether this process hosts it (``report`` and ``deadline``:
    as :func:`endpoint_store`'s, for a client)."""
    sock = _bind_loopback(port) if host is not False else None
    if sock is None:
        if host:
            raise RuntimeError(f"{LOOPBACK_HOST}:{port} is taken; cannot host the rendezvous store")
        until = deadline or time.monotonic() + timeout.total_seconds()
        _reach(LOOPBACK_HOST, port, until, report)  # nothing listens yet: say so, not "another program"
        return _connect(LOOPBACK_HOST, port, timeout, until, report), False
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
    ), True


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one it can listen on."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def _reach(host: str, port: int, deadline: float, report: Meeting | None) -> None:
    """Wait until ``host:port`` accepts connections, saying every few seconds why not yet.

    torch's store client retries silently for its whole timeout; a mistyped address or a
    closed port should be visible within seconds.
    """
    start = time.monotonic()
    next_line = start + (report.interval if report else float("inf"))
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        now = time.monotonic()
        if now >= deadline:
            raise RendezvousConnectionError(
                f"cannot reach the rendezvous at {host}:{port} ({why}) for "
                f"{now - start:.0f} s. Check that the first machine's launcher runs, that "
                f"{host} is its address as this machine sees it, and that port {port} is "
                "open in the firewall."
            )
        if report is not None and now >= next_line:
            report.say(
                f"waiting for the rendezvous at {host}:{port} (job {report.run_id}): cannot "
                f"reach it yet ({why}) after {now - start:.0f} s; giving up at "
                f"{report.join_timeout:.0f} s. Is the first machine's launcher started, "
                "the address right and the port open?"
            )
            next_line = now + report.interval
        time.sleep(0.5)


def endpoint_store(
    host: str, port: int, timeout: timedelta, is_host: bool | None = None,
    report: Meeting | None = None, deadline: float | None = None,
) -> tuple[dist.TCPStore, bool]:
    """The multi-machine rendezvous store at ``host:port``, and whether this process hosts it.

    The launcher on the machine that owns ``host`` hosts it (the first to bind the port, when
    several launchers share that machine); the others connect once the port answers.
    """
    if is_host is not False and _is_this_machine(host):
        try:
            return dist.TCPStore(
                "" if not _is_ip(host) else host, port, is_master=True, timeout=timeout,
                wait_for_workers=False, multi_tenant=True,
            ), True
        except (RuntimeError, ValueError):  # the port is taken: another launcher hosts it
            if is_host:
                raise
    until = deadline or time.monotonic() + timeout.total_seconds()
    _reach(host, port, until, report)
    return _connect(host, port, timeout, until, report), False


def _connect(host: str, port: int, timeout: timedelta, deadline: float,
             report: Meeting | None) -> dist.TCPStore:
    """torch's store client at ``host:port``, or an error by ``deadline``.

    The port answers (see :func:`_reach`), but what listens there may be another program (a web
    server, a stale process): torch's client then waits for its handshake forever, whatever its
    timeout. So it is made in a thread, and this one gives up at the deadline, saying so.
    """
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, is_master=False, timeout=timeout,
                                          multi_tenant=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            made["error"] = exc

    thread = threading.Thread(target=make, name="lockstep-rendezvous-connect", daemon=True)
    thread.start()
    start = time.monotonic()
    next_line = start + (report.interval if report else float("inf"))
    while thread.is_alive():
        thread.join(0.2)
        now = time.monotonic()
        if not thread.is_alive():
            break
        if now >= deadline:
            raise RendezvousConnectionError(
                f"{host}:{port} accepts connections, but no rendezvous store answered there for "
                f"{now - start:.0f} s: another program holds port {port} (a web server, a "
                "process of an earlier job?). Stop it, or give every machine another port in "
                "--rdzv-endpoint."
            )
        if report is not None and now >= next_line:
            report.say(
                f"waiting for the rendezvous at {host}:{port} (job {report.run_id}): the port "
                f"answers but no rendezvous store replies after {now - start:.0f} s; giving up "
                f"at {report.join_timeout:.0f} s. Is another program holding port {port}?"
            )
            next_line = now + report.interval
    if "error" in made:
        raise made["error"]
    return made["store"]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
