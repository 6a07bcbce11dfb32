"""Pipeline schedules as plain data: for each stage, the ordered list of what it computes.

A schedule is ``list[list[Action]]``: ``schedule[s]`` is what stage ``s`` does, in order.
``F3`` runs micro-batch 3 forward, ``B3`` runs it backward. Nothing here touches a tensor or
a process, so schedules are printed, simulated and unit-tested on their own.

* GPipe (Huang et al., 2019, arXiv:1811.06965): every forward, then every backward. A stage
  holds the activations of all ``m`` micro-batches at once.
* 1F1B (PipeDream-Flush, Narayanan et al., 2021, arXiv:2006.09503): after a warm-up of
  ``p - s - 1`` forwards, stage ``s`` alternates one forward and one backward, so it holds at
  most ``p - s`` micro-batches, whatever ``m`` is.

Both leave the same idle share per stage, ``(p - 1) / (m + p - 1)`` when forward and backward
of every stage cost the same; :func:`simulate` computes it for any schedule and costs.

Example::

    >>> print(format_schedule(one_f_one_b(num_stages=2, num_microbatches=3)))
    stage 0: F0 F1 B0 F2 B1 B2
    stage 1: F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "Timeline",
    "bubble_fraction",
    "format_schedule",
    "format_timeline",
    "forward_only",
    "get_schedule",
    "gpipe",
    "in_flight_peaks",
    "one_f_one_b",
    "simulate",
    "validate_schedule",
]

Phase = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work of a stage: micro-batch ``microbatch`` forward (``"F"``) or backward."""

    phase: Phase
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}"


Schedule = list[list[Action]]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, in micro-batch order on every stage."""
    _check_sizes(num_stages, num_microbatches)
    forwards = [Action("F", i) for i in range(num_microbatches)]
    backwards = [Action("B", i) for i in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then the rest backward."""
    _check_sizes(num_stages, num_microbatches)
    schedule: Schedule = []
    for stage in range(num_stages):
        # A stage needs p - s - 1 micro-batches ahead in flight before the first gradient can
        # come back from the last stage; more would only cost memory.
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Forwards only (evaluation): every stage runs each micro-batch forward, in order."""
    _check_sizes(num_stages, num_microbatches)
    return [[Action("F", i) for i in range(num_microbatches)] for _ in range(num_stages)]


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called ``name`` (``"gpipe"`` or ``"1f1b"``, any case) for these sizes."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[key](num_stages, num_microbatches)


def validate_schedule(schedule: Schedule, num_microbatches: int) -> None:
    """Check that every stage runs each micro-batch forward once, and backward at most once after.

    Raises:
        ValueError: naming the stage and micro-batch at fault.
    """
    for stage, actions in enumerate(schedule):
        forwards = [a.microbatch for a in actions if a.phase == "F"]
        if sorted(forwards) != list(range(num_microbatches)):
            raise ValueError(
                f"stage {stage} must run micro-batches 0..{num_microbatches - 1} forward exactly "
                f"once, its schedule has forwards {forwards}"
            )
        seen: set[int] = set()
        for action in actions:
            if action.phase == "F":
                seen.add(action.microbatch)
            elif action.microbatch not in seen:
                raise ValueError(f"stage {stage} runs {action} before F{action.microbatch}")
            else:
                seen.discard(action.microbatch)


@dataclass(frozen=True)
class Timeline:
    """When each action of a schedule starts, as simulated by :func:`simulate`.

    Attributes:
        starts: ``starts[s][k]`` is the start time of ``schedule[s][k]``.
        durations: ``durations[s][k]`` is how long it runs.
        makespan: time from the first start to the last end.
    """

    starts: list[list[float]]
    durations: list[list[float]]
    makespan: float

    def bubble_fractions(self) -> list[float]:
        """Idle share of the makespan, per stage."""
        if self.makespan == 0:
            return [0.0 for _ in self.durations]
        return [1.0 - sum(d) / self.makespan for d in self.durations]

    def bubble_fraction(self) -> float:
        """Idle share of all stages' time together."""
        fractions = self.bubble_fractions()
        return sum(fractions) / len(fractions)

    def order(self) -> list[tuple[int, int]]:
        """Every ``(stage, index)`` by start time: a valid order to run them in one process."""
        items = [(t, s, k) for s, row in enumerate(self.starts) for k, t in enumerate(row)]
        return [(s, k) for _, s, k in sorted(items)]


def _dependency(stage: int, action: Action, num_stages: int) -> tuple[int, Action] | None:
    """The action of a neighbouring stage that must finish before ``action`` can start."""
    if action.phase == "F":
        return (stage - 1, action) if stage > 0 else None
    return (stage + 1, action) if stage < num_stages - 1 else None


def simulate(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 1.0
) -> Timeline:
    """Play a schedule with fixed costs per action, as stages on separate devices would.

    A forward waits for the same micro-batch's forward on the stage before; a backward waits for
    its backward on the stage after; each stage runs its own list in order.

    Raises:
        ValueError: the schedule deadlocks (an action waits on one that can never run).
    """
    num_stages = len(schedule)
    ends: dict[tuple[int, Action], float] = {}
    starts = [[0.0] * len(row) for row in schedule]
    durations = [
        [forward_time if a.phase == "F" else backward_time for a in row] for row in schedule
    ]
    cursor = [0] * num_stages
    free_at = [0.0] * num_stages
    remaining = sum(len(row) for row in schedule)
    while remaining:
        progressed = False
        for s, row in enumerate(schedule):
            while cursor[s] < len(row):
                action = row[cursor[s]]
                dep = _dependency(s, action, num_stages)
                if dep is not None and dep not in ends:
                    break
                start = max(free_at[s], ends[dep] if dep is not None else 0.0)
                starts[s][cursor[s]] = start
                free_at[s] = start + durations[s][cursor[s]]
                ends[(s, action)] = free_at[s]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {schedule[s][cursor[s]]}" for s in range(num_stages)
                     if cursor[s] < len(schedule[s])]
            raise ValueError(f"schedule deadlocks: {', '.join(stuck)} wait forever")
    makespan = max(free_at) if free_at else 0.0
    return Timeline(starts, durations, makespan)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Theoretical idle share of GPipe and 1F1B with equal costs: ``(p - 1) / (m + p - 1)``."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def in_flight_peaks(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches run forward but not yet backward at once.

    Each holds its saved activations, so this is peak activation memory in micro-batches.
    """
    peaks = []
    for actions in schedule:
        live = peak = 0
        for action in actions:
            live += 1 if action.phase == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def format_schedule(schedule: Schedule) -> str:
    """One line per stage listing its actions in order, e.g. ``stage 0: F0 F1 B0 B1``."""
    return "\n".join(
        f"stage {s}: " + " ".join(str(a) for a in actions) for s, actions in enumerate(schedule)
    )


def format_timeline(schedule: Schedule, timeline: Timeline | None = None) -> str:
    """A time chart, one column per unit of time, ``..`` where the stage is idle.

    Costs must be whole numbers of units (the default :func:`simulate` costs are).
    """
    timeline = timeline or simulate(schedule)
    width = round(timeline.makespan)
    lines = []
    for s, actions in enumerate(schedule):
        cells = [".."] * width
        for k, action in enumerate(actions):
            first = round(timeline.starts[s][k])
            for t in range(first, first + round(timeline.durations[s][k])):
                cells[t] = str(action).ljust(2)
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)
