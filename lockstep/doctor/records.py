"""What one rank records per step, and the phases a step splits into.

A step runs from the end of the previous optimizer step to the end of this one. Inside it:
``data`` (until the first forward, from the last optimizer step before it: a second optimizer
of the model steps after the first one closed the step, and that is optimizer time), ``forward``, ``backward`` (first gradient to last),
``exposed_comm`` (after the last gradient, waiting for all-reduces), ``optimizer``, and
``other``: host time between those phases (the loss, ``zero_grad``, gradient clipping). Every
phase is measured, so they add up to the step's wall time exactly; ``other`` is the part the
doctor cannot explain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# DDP's step_timings record lives under both DDP and the doctor (lockstep.profilers); re-exported.
from lockstep.profilers import StepTiming

__all__ = ["PHASES", "BucketEvents", "StepRecord", "StepTiming", "phases_of"]

# Order matters: the timeline and the account list phases in this order.
PHASES = ("data", "forward", "backward", "exposed_comm", "optimizer", "other")


@dataclass
class BucketEvents:
    """One bucket's all-reduce in one backward: seconds on this rank's clock (None: not seen)."""

    index: int
    ready: float | None = None  # its last gradient arrived
    last_param: str | None = None  # the parameter whose gradient made it ready
    launch: float | None = None  # handed to the comm hook
    done: float | None = None  # the comm hook's future completed
    waited: float | None = None  # the end of backward's wait on it returned

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "ready": self.ready, "last_param": self.last_param,
                "launch": self.launch, "done": self.done, "waited": self.waited}


@dataclass
class StepRecord:
    """One optimizer step on one rank: absolute times (``time.perf_counter`` seconds).

    Several forwards and backwards per step happen under ``no_sync`` accumulation.
    """

    begin: float
    end: float = 0.0
    forwards: list[list[float]] = field(default_factory=list)  # [start, synced, end]
    backwards: list[list[float]] = field(default_factory=list)  # [start, compute_end, end]
    optimizer: list[list[float]] = field(default_factory=list)  # [start, end]
    buckets: list[BucketEvents] = field(default_factory=list)
    synced: bool = False  # a backward that reduced gradients ended in this step
    samples: int = 0  # the batch sizes of this step's forwards, summed (accumulation: several)

    def to_json(self) -> dict[str, Any]:
        return {"begin": self.begin, "end": self.end, "forwards": self.forwards,
                "backwards": self.backwards, "optimizer": self.optimizer,
                "buckets": [b.to_json() for b in self.buckets]}


def phases_of(step: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase (see :data:`PHASES`) and ``step``, from a :meth:`StepRecord.to_json`."""
    begin, end = step["begin"], step["end"]
    first = step["forwards"][0][0] if step["forwards"] else begin
    # A step closes at its first optimizer's end; a second optimizer (two optimizers on one
    # model) steps after that, before the next forward: optimizer time, not data.
    data_from = max([begin, *(e for _, e in step["optimizer"] if e <= first)])
    # A forward's first part waits on collectives (buffer broadcast, join's announcement):
    # communication nothing hides, so it counts as exposed, not as forward compute.
    out = {
        "data": max(0.0, first - data_from),
        "forward": sum(e - m for _, m, e in step["forwards"]),
        "backward": sum(c - s for s, c, _ in step["backwards"]),
        "exposed_comm": sum(e - c for _, c, e in step["backwards"])
        + sum(m - s for s, m, _ in step["forwards"]),
        "optimizer": sum(e - s for s, e in step["optimizer"]),
        "step": end - begin,
    }
    out["other"] = out["step"] - sum(out[p] for p in PHASES if p != "other")
    return out
