"""The environment ``lockstep run`` adds for its workers: thread counts and loopback-only gloo."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["loopback_gloo", "omp_threads"]

_LOOPBACK_IFNAME = "lo"  # Linux's name for the loopback interface


def omp_threads(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for workers sharing a machine, unless the user chose it.

    Several workers each running one OpenMP thread per core oversubscribe the CPU many times
    over; each gets an equal share of the cores this process may use instead.
    """
    if nproc < 2 or "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // nproc))}


def loopback_gloo(environ: Mapping[str, str]) -> dict[str, str]:
    """Keep gloo's listening sockets on loopback for a single-machine job.

    gloo otherwise listens on the address the host name resolves to, which may face a network.
    """
    if "GLOO_SOCKET_IFNAME" in environ or not hasattr(socket, "if_nameindex"):
        return {}
    names = {name for _, name in socket.if_nameindex()}
    return {"GLOO_SOCKET_IFNAME": _LOOPBACK_IFNAME} if _LOOPBACK_IFNAME in names else {}
