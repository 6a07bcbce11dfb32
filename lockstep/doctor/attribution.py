"""Cross-rank attribution: who is the straggler and where, what communication cost, what hid.

The all-reduce makes every rank's step as long as the slowest rank's, so a straggler does not
show in its own profile: it shows as the *others* waiting. Each rank's own work in a step is its
step minus its exposed wait; the rank with the most own work is the one the others waited for.
A rank is named the straggler only when it is the slowest in most steps and by a clear margin
(a healthy run has a slowest rank in every step too, changing at random).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from lockstep.doctor.records import PHASES

__all__ = [
    "STRAGGLER_SHARE",
    "STRAGGLER_STEPS",
    "WORK_PHASES",
    "Attribution",
    "ExposedBucket",
    "Straggler",
    "attribute",
    "critical_steps",
    "straggler_from_means",
]

WORK_PHASES = ("data", "forward", "backward", "optimizer", "other")
STRAGGLER_SHARE = 0.10  # named when slower on average by this share of the step in a phase
STRAGGLER_STEPS = 0.6  # ...and it is the slowest rank in at least this share of the steps


def _own(row: dict[str, float]) -> float:
    return row["step"] - row["exposed_comm"]


@dataclass
class Straggler:
    """The rank the others waited for (``rank`` None: none stands out)."""

    rank: int | None
    phase: str | None  # where it is slower than the others
    waited_s: float  # mean seconds per step the other ranks waited (max own work - mean)
    phase_excess_s: float  # its extra seconds in ``phase`` over the others' mean
    slowest_share: float  # share of steps in which it was the slowest
    step_s: float

    def sentence(self) -> str:
        if self.rank is None:
            return (f"no straggler: ranks wait {self.waited_s * 1e3:.1f} ms per step for each "
                    "other, the slowest rank changing from step to step")
        return (f"straggler rank {self.rank} in {self.phase} (+{self.phase_excess_s * 1e3:.1f} ms"
                f"); the others wait {self.waited_s * 1e3:.1f} ms per step "
                f"({self.waited_s / self.step_s:.0%} of the step) for it")


@dataclass
class ExposedBucket:
    """The bucket whose all-reduce the end of backward waits on most."""

    index: int
    bytes: int
    exposed_s: float
    allreduce_s: float
    ready_s: float  # after backward starts
    ready_share: float  # the same, as a share of backward compute
    last_param: str | None  # the parameter whose gradient made it ready
    params: list[str] = field(default_factory=list)

    def sentence(self) -> str:
        when = f"{self.ready_share:.0%} into backward"
        who = f", waiting for {self.last_param!r} whose gradient arrives {when}" \
            if self.last_param else ""
        return (f"bucket {self.index} ({self.bytes / 2**20:.2f} MB{who}) leaves "
                f"{self.exposed_s * 1e3:.1f} ms of its {self.allreduce_s * 1e3:.1f} ms "
                "all-reduce exposed")


@dataclass
class Attribution:
    """What the doctor concludes from one run's profile."""

    straggler: Straggler
    exposed_comm_s: float
    exposed_bucket: ExposedBucket | None
    allreduce_s: float  # sum of the buckets' all-reduce times per step
    hidden_share: float  # share of all-reduce time that backward hid
    busbw: float  # bytes/s over all buckets (bus-bandwidth convention)
    # Mean seconds per phase of the ranks that waited (all but each step's slowest): the
    # work every rank does, without the straggler's excess; the speedup account starts here.
    baseline: dict[str, float] = field(default_factory=dict)
    # False when a run of several ranks timed no bucket's all-reduce (torch's DDP with a comm
    # hook registered before the first forward): ``hidden_share`` and ``busbw`` are then unknown
    buckets_observed: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def critical_steps(matrix: list[list[dict[str, float]]]) -> list[int]:
    """Per step, the rank with the most own work (the one the others waited for)."""
    n = len(matrix[0]) if matrix else 0
    return [max(range(len(matrix)), key=lambda r: _own(matrix[r][k])) for k in range(n)]


def _straggler(matrix: list[list[dict[str, float]]], step_s: float) -> Straggler:
    if len(matrix) < 2 or not matrix[0]:
        return Straggler(None, None, 0.0, 0.0, 0.0, step_s)
    crit = critical_steps(matrix)
    n, ranks = len(crit), range(len(matrix))
    waited = statistics.fmean(
        _own(matrix[s][k]) - statistics.fmean(_own(matrix[r][k]) for r in ranks if r != s)
        for k, s in enumerate(crit))
    top = max(ranks, key=crit.count)
    share = crit.count(top) / n
    excess = {
        p: statistics.fmean(matrix[top][k][p] for k in range(n))
        - statistics.fmean(matrix[r][k][p] for r in ranks if r != top for k in range(n))
        for p in WORK_PHASES
    }
    phase = max(excess, key=lambda p: excess[p])
    # Systematic, not the per-step maximum: noise makes some rank the slowest in every step,
    # but only a real straggler is slower on average, by a share of the step, and clearly so
    # against the step-to-step scatter (mean excess at least 3 standard errors).
    gaps = [_own(matrix[top][k]) - statistics.fmean(_own(matrix[r][k]) for r in ranks if r != top)
            for k in range(n)]
    spread = statistics.stdev(gaps) / n**0.5 if n > 1 else 0.0
    clear = statistics.fmean(gaps) >= 3 * spread
    named = clear and share >= STRAGGLER_STEPS and excess[phase] >= STRAGGLER_SHARE * step_s
    return Straggler(top if named else None, phase if named else None, waited,
                     excess[phase] if named else 0.0, share, step_s)


def straggler_from_means(rows: list[dict[str, float]]) -> Straggler:
    """The straggler from per-rank phase means (the periodic in-job summary)."""
    return _straggler([[row] for row in rows], statistics.fmean(r["step"] for r in rows))


def attribute(profile: dict[str, Any], matrix: list[list[dict[str, float]]]) -> Attribution:
    """Name the straggler, the most exposed bucket, the bandwidth, and what backward hid."""
    phases = profile["phases"]
    straggler = _straggler(matrix, phases["step"])
    buckets = profile.get("buckets", [])
    worst = max(buckets, key=lambda b: b["exposed"], default=None)
    exposed = None
    if worst is not None and worst["exposed"] > 0:
        exposed = ExposedBucket(worst["index"], worst["bytes"], worst["exposed"],
                                worst["allreduce"], worst["ready"], worst["ready_share"],
                                worst["last_param"],
                                worst["params"])
    total_time = sum(b["allreduce"] for b in buckets)
    total_bytes = sum(b["bytes"] for b in buckets)
    world = profile["world_size"]
    bus = total_bytes / total_time * 2 * (world - 1) / world if total_time > 0 else 0.0
    # Exposure is what the step took beyond the slowest rank's own work: communication nobody
    # hid (the others' waits also include waiting for the slowest rank, which is not).
    crit = critical_steps(matrix) if matrix and matrix[0] else []
    ranks = range(len(matrix))
    critical_exposed = statistics.fmean(
        statistics.fmean(matrix[r][k]["step"] for r in ranks) - _own(matrix[s][k])
        for k, s in enumerate(crit)) if crit else phases.get("exposed_comm", 0.0)
    observed = world == 1 or total_time > 0
    # nothing to hide at world 1; unknown (reported as 0, with buckets_observed False) when the
    # all-reduces were not seen
    hidden = max(0.0, 1 - critical_exposed / total_time) if total_time > 0 else float(world == 1)
    return Attribution(straggler, critical_exposed, exposed, total_time, hidden, bus,
                       _baseline(matrix, crit) if len(matrix) > 1 else dict(phases),
                       observed)


def _baseline(matrix: list[list[dict[str, float]]], crit: list[int]) -> dict[str, float]:
    if not crit:
        raise ValueError("attribute: no step after warm-up; the run ended within its warm-up")
    ranks = range(len(matrix))
    return {p: statistics.fmean(statistics.fmean(matrix[r][k][p] for r in ranks if r != s)
                                for k, s in enumerate(crit)) for p in (*PHASES, "step")}

