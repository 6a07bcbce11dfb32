"""The environment ``lockstep run`` adds for its workers: thread counts and loopback-only gloo."""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.env import OMP_FROM_LAUNCHER_ENV, loopback_gloo, threads_per_share

__all__ = ["loopback_gloo", "omp_threads"]


def omp_threads(nproc: int, environ: Mapping[str, str], virtual_shards: int | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for workers sharing a machine, unless the user chose it.

    Several workers each running one OpenMP thread per core oversubscribe the CPU many times
    over; each gets an equal share of the cores this process may use instead. With
    ``virtual_shards`` the share is that of ``virtual_shards`` workers whatever ``nproc`` is:
    a CPU reduction's bits depend on its thread count, and a virtual-shard run must give the
    same bits at every world size.
    """
    if "OMP_NUM_THREADS" in environ or (nproc < 2 and virtual_shards is None):
        return {OMP_FROM_LAUNCHER_ENV: "0"}  # the user's count, or none: not the launcher's
    return {"OMP_NUM_THREADS": str(threads_per_share(virtual_shards or nproc)),
            OMP_FROM_LAUNCHER_ENV: "1"}
