"""Measure this machine's own collective: an all-reduce sweep and a least-squares alpha-beta fit.

``measure_link(nproc=2)`` starts ``nproc`` ranks with :func:`lockstep.spawn` (gloo on CPU, NCCL
when every rank has a GPU), all-reduces float32 tensors from a few KB to a few MB, keeps the
median time of each size, and fits the ring model ``t(S) = 2(n-1) alpha + 2(n-1)/n * S/beta`` by
least squares: the intercept gives alpha, the slope beta (a bus bandwidth, nccl-tests'
convention).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

from lockstep.plan.links import Link

__all__ = ["DEFAULT_SIZES", "fit_alpha_beta", "measure_link"]

DEFAULT_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float], world: int) -> Link:
    """Least-squares ring alpha and beta from all-reduce times of ``sizes`` bytes on ``world`` ranks.

    Raises:
        ValueError: fewer than two distinct sizes, or a fit with no positive slope.
    """
    if world < 2:
        raise ValueError("a link needs at least 2 ranks to measure")
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("fit needs times for at least two distinct sizes")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError(f"all-reduce time did not grow with size ({list(seconds)}): the machine "
                         "was too noisy; measure again with larger sizes or more repeats")
    alpha = max(intercept, 0.0) / (2 * (world - 1))
    beta = 2 * (world - 1) / world / slope
    return Link("measured", alpha, beta, f"measured all-reduce sweep, {world} ranks")


def _sweep(rank: int, sizes: Sequence[int], repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    import lockstep

    info = lockstep.init_distributed()
    medians = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device=info.device)
        for _ in range(2):  # warm-up: connections, allocator
            dist.all_reduce(t)
        # Several all-reduces back to back per sample, as DDP's buckets follow one another: one
        # late wake-up of a rank on a busy machine then costs a share of the sample, not all.
        inner = max(1, min(16, (16 << 20) // max(nbytes, 1)))
        times = []
        for _ in range(repeats):
            dist.barrier()
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            start = time.perf_counter()
            for _ in range(inner):
                dist.all_reduce(t)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            times.append((time.perf_counter() - start) / inner)
        medians.append(statistics.median(times))
    dist.barrier()
    return medians


def measure_link(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 10,
                 timeout: float = 300.0) -> Link:
    """Spawn ``nproc`` ranks on this machine, all-reduce ``sizes`` bytes, fit alpha and beta.

    Each rank runs one thread; the slowest rank's median per size enters the fit.
    """
    from lockstep.multiproc import spawn

    if nproc < 2:
        raise ValueError(f"--measure-link needs at least 2 ranks, got {nproc}")
    results = spawn(_sweep, nproc, (list(sizes), repeats), timeout=timeout,
                    start_method=os.environ.get("LOCKSTEP_START_METHOD"))
    worst = [max(r[i] for r in results) for i in range(len(sizes))]
    return fit_alpha_beta(list(sizes), worst, nproc)
