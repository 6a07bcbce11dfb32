"""The environment ``lockstep run`` adds for its workers: thread counts and loopback-only gloo."""

from __future__ import annotations

import os
from collections.abc import Mapping

from lockstep.env import loopback_gloo

__all__ = ["loopback_gloo", "omp_threads"]


def omp_threads(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for workers sharing a machine, unless the user chose it.

    Several workers each running one OpenMP thread per core oversubscribe the CPU many times
    over; each gets an equal share of the cores this process may use instead.
    """
    if nproc < 2 or "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // nproc))}
