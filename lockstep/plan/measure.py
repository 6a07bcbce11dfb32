"""Measure this machine's own collective: an all-reduce sweep and a weighted alpha-beta fit.

``measure_link(nproc=2)`` starts ``nproc`` ranks with :func:`lockstep.spawn` (gloo on CPU, NCCL
when every rank has a GPU) and runs :func:`sweep_allreduce` there: after a warm-up with the
largest message, ``rounds`` rounds each all-reduce every size once (several back to back for
small ones), so that a burst of load elsewhere on the machine lands on one round of every size,
not on every round of one size. For each round and size the slowest rank's time counts; the
median over rounds per size is fitted to the ring model ``t(S) = 2(n-1) alpha + 2(n-1)/n * S/beta``
by least squares on *relative* error (small messages set alpha, large ones beta; neither
drowns the other): the intercept gives alpha, the slope beta (a bus bandwidth, nccl-tests'
convention). Each round is also fitted alone; the spread of those fits says how stable the
link was while it was measured (:meth:`LinkSweep.describe`).

Each sample also reads the process's CPU time (every thread: gloo's too). Fitted the same way,
it splits an all-reduce into the rank's own CPU work and waiting (``Link.cpu_share``): on a CPU
machine whose ranks time-share the cores (``PlanOptions.cpu_cores``) only the work competes for
them. CPU time is also steadier than wall time on a busy machine: it does not count the waits
for a descheduled peer.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.plan.links import Link

__all__ = ["DEFAULT_SIZES", "LinkSweep", "fit_alpha_beta", "measure_copy_rate", "measure_link",
           "measure_link_sweep", "sweep_allreduce"]

# 4 KB to 32 MB: DDP sends a 1 MB first bucket, then buckets up to 25 MB.
DEFAULT_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
DEFAULT_ROUNDS = 15
_BACK_TO_BACK_BYTES = 16 << 20  # small sizes repeat up to this many bytes (at most 16 times)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float], world: int) -> Link:
    """Ring alpha and beta from all-reduce times of ``sizes`` bytes on ``world`` ranks.

    Least squares on relative error (each point weighted by ``1 / t**2``), so a 5% wobble of
    the largest message does not move alpha by more than the smallest message's whole time.

    Raises:
        ValueError: fewer than two distinct sizes, or a fit with no positive slope.
    """
    if world < 2:
        raise ValueError("a link needs at least 2 ranks to measure")
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("fit needs times for at least two distinct sizes")
    if min(seconds) <= 0:
        raise ValueError(f"all-reduce times must be positive, got {list(seconds)}")
    w = [1 / y**2 for y in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError(f"all-reduce time did not grow with size ({list(seconds)}): the machine "
                         "was too noisy; measure again with larger sizes or more repeats")
    alpha = max(intercept, 0.0) / (2 * (world - 1))
    beta = 2 * (world - 1) / world / slope
    return Link("measured", alpha, beta, f"measured all-reduce sweep, {world} ranks")


@dataclass(frozen=True)
class LinkSweep:
    """An all-reduce sweep: seconds per round and size (the slowest rank's wall time, the
    ranks' mean CPU time), and their fits."""

    world: int
    sizes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [round][size], wall
    cpu_seconds: tuple[tuple[float, ...], ...] | None = None  # [round][size], per rank

    def medians(self, cpu: bool = False) -> list[float]:
        """Median over rounds of each size's wall (or CPU) time."""
        rows = self.cpu_seconds if cpu and self.cpu_seconds is not None else self.seconds
        return [statistics.median(r[i] for r in rows) for i in range(len(self.sizes))]

    @property
    def link(self) -> Link:
        """The fit of the per-size medians (what the planner uses), with its CPU share."""
        wall = fit_alpha_beta(self.sizes, self.medians(), self.world)
        share = None
        if self.cpu_seconds is not None:
            try:
                cpu = fit_alpha_beta(self.sizes, self.medians(cpu=True), self.world)
                share = (cpu.alpha / wall.alpha if wall.alpha > 0 else 1.0, wall.beta / cpu.beta)
            except ValueError:
                share = None  # CPU time did not grow with size: unknown, counted as all work
        return Link(wall.name, wall.alpha, wall.beta,
                    f"measured all-reduce sweep, {self.world} ranks, {len(self.seconds)} rounds",
                    share)

    def round_links(self) -> list[Link]:
        """One fit per round (rounds too noisy to fit are left out)."""
        out = []
        for times in self.seconds:
            try:
                out.append(fit_alpha_beta(self.sizes, times, self.world))
            except ValueError:
                continue
        return out

    def round_shares(self) -> list[tuple[float, float]]:
        """The CPU share (of the latency, of the bandwidth term) of each round's own fits of
        wall and CPU time (rounds too noisy to fit are left out; none without CPU times)."""
        out: list[tuple[float, float]] = []
        for wall_times, cpu_times in zip(self.seconds, self.cpu_seconds or (), strict=False):
            try:
                wall = fit_alpha_beta(self.sizes, wall_times, self.world)
                cpu = fit_alpha_beta(self.sizes, cpu_times, self.world)
            except ValueError:
                continue
            out.append((cpu.alpha / wall.alpha if wall.alpha > 0 else 1.0, wall.beta / cpu.beta))
        return out

    def spread(self) -> dict[str, tuple[float, float]]:
        """Lowest and highest alpha (s) and beta (bytes/s) over the rounds' own fits; with CPU
        times, also of the CPU share of the latency and of the bandwidth term
        (``"cpu_latency_share"``, ``"cpu_bandwidth_share"``)."""
        fits = self.round_links() or [self.link]
        out = {"alpha": (min(f.alpha for f in fits), max(f.alpha for f in fits)),
               "beta": (min(f.beta for f in fits), max(f.beta for f in fits))}
        shares = self.round_shares()
        if shares:
            out["cpu_latency_share"] = (min(a for a, _ in shares), max(a for a, _ in shares))
            out["cpu_bandwidth_share"] = (min(b for _, b in shares), max(b for _, b in shares))
        return out

    def describe(self) -> str:
        link, spread = self.link, self.spread()
        (a0, a1), (b0, b1) = spread["alpha"], spread["beta"]
        text = (f"alpha {link.alpha * 1e6:.1f} us, beta {link.beta / 1e9:.3g} GB/s at world "
                f"{self.world} (median of {len(self.seconds)} rounds; single rounds: alpha "
                f"{a0 * 1e6:.0f}-{a1 * 1e6:.0f} us, beta {b0 / 1e9:.3g}-{b1 / 1e9:.3g} GB/s)")
        if link.cpu_share is not None:
            text += (f"; CPU work: {link.cpu_share[0]:.0%} of the latency, "
                     f"{link.cpu_share[1]:.0%} of the bandwidth term")
        return text

    @staticmethod
    def combine(per_rank: Sequence[dict[str, Any]], sizes: Sequence[int]) -> LinkSweep:
        """Every rank's :func:`sweep_allreduce` result in one: per round and size, the slowest
        rank's wall time and the ranks' mean CPU time."""
        rounds = min(len(r["wall"]) for r in per_rank)
        n = len(per_rank)
        cols = range(len(sizes))
        wall = tuple(tuple(max(r["wall"][k][i] for r in per_rank) for i in cols)
                     for k in range(rounds))
        cpu = tuple(tuple(sum(r["cpu"][k][i] for r in per_rank) / n for i in cols)
                    for k in range(rounds))
        return LinkSweep(n, tuple(int(s) for s in sizes), wall, cpu)


def sweep_allreduce(sizes: Sequence[int], rounds: int = DEFAULT_ROUNDS,
                    group: Any = None) -> dict[str, list[list[float]]]:
    """This rank's seconds per all-reduce, ``{"wall": [round][size], "cpu": [round][size]}``.

    Call it on every rank of ``group`` (an initialised process group). Float32 tensors on this
    rank's device (the current CUDA device when the backend is NCCL). ``cpu`` is the process's
    CPU time over the same span (all its threads).
    """
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tensors = [torch.ones(max(1, n // 4), device=device) for n in sizes]

    def run(t: torch.Tensor, times: int) -> tuple[float, float]:
        dist.barrier(group)
        if cuda:
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(times):
            dist.all_reduce(t, group=group)
        if cuda:
            torch.cuda.synchronize(device)
        return ((time.perf_counter() - start) / times, (time.process_time() - cpu) / times)

    # Warm-up: connections, allocator, and the sockets' buffers grown to the largest message.
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    run(tensors[largest], 3)
    for t in tensors:
        run(t, 1)
    # Several all-reduces back to back per sample, as DDP's buckets follow one another: one
    # late wake-up of a rank on a busy machine then costs a share of the sample, not all.
    inner = [max(1, min(16, _BACK_TO_BACK_BYTES // max(n, 1))) for n in sizes]
    samples = [[run(t, k) for t, k in zip(tensors, inner)] for _ in range(rounds)]
    dist.barrier(group)
    return {"wall": [[w for w, _ in row] for row in samples],
            "cpu": [[c for _, c in row] for row in samples]}


def _sweep(rank: int, sizes: Sequence[int], rounds: int) -> dict[str, list[list[float]]]:
    from lockstep.distributed import init_distributed

    init_distributed()
    return sweep_allreduce(sizes, rounds)


def measure_link_sweep(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                       repeats: int = DEFAULT_ROUNDS, timeout: float = 300.0) -> LinkSweep:
    """Spawn ``nproc`` ranks on this machine and sweep ``repeats`` rounds of ``sizes`` bytes."""
    from lockstep.launcher.spawn import spawn

    if nproc < 2:
        raise ValueError(f"--measure-link needs at least 2 ranks, got {nproc}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results = spawn(_sweep, nproc, (list(sizes), repeats), timeout=timeout,
                    start_method=os.environ.get("LOCKSTEP_START_METHOD"))
    return LinkSweep.combine(results, sizes)


def measure_link(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                 repeats: int = DEFAULT_ROUNDS, timeout: float = 300.0) -> Link:
    """This machine's all-reduce alpha and beta on ``nproc`` local ranks (one thread each)."""
    return measure_link_sweep(nproc, sizes, repeats, timeout).link


def measure_copy_rate(nbytes: int = 32 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s that one plain copy of ``nbytes`` moves on ``device``, the read and the write
    both counted (the unit of :attr:`~lockstep.plan.model.PlanOptions.codec_bandwidth`); the
    median of ``repeats`` copies after one warm-up.

    DDP's bucket copies cannot be faster than this, so it is the optimistic end of the rate
    that prices them; on a CPU they are slower in practice (many tensors per bucket, and the
    core is shared with gloo's own copies and sums), which the default rate stands for.
    """
    import torch

    if nbytes < 4 or repeats < 1:
        raise ValueError(f"need at least 4 bytes and 1 repeat, got {nbytes} bytes, {repeats}")
    dev = torch.device(device)
    source = torch.ones(nbytes // 4, device=dev)
    target = torch.empty_like(source)

    def once() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        target.copy_(source)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    once()
    seconds = statistics.median(once() for _ in range(repeats))
    return 2 * source.numel() * 4 / max(seconds, 1e-9)
