"""Intervals, not points: a prediction's low-high range and the input that dominates it.

Each uncertain input has a range (:mod:`lockstep.plan.transports`: achievable link efficiency and
per-message cost; :mod:`lockstep.plan.stragglers`: the ranks' step-time spread). The step is
predicted with every input at its optimistic end, at its expected value and at its pessimistic
end; the efficiency range is the step range inverted. The *dominant* input is the one whose swing
alone, from expected to pessimistic with the others at expected, moves the step the most
(:data:`NO_SWING` when none moves it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lockstep.plan.links import Topology
from lockstep.plan.model import PlanOptions, Prediction, predict
from lockstep.plan.strategies import Strategy
from lockstep.plan.transports import TRANSPORTS, Transport
from lockstep.plan.workload import Workload

__all__ = ["INPUTS", "NO_SWING", "Interval", "predict_interval"]

INPUTS = ("link efficiency", "per-message cost", "step-time spread")
# The dominant input when no input moves the step (until 2026-11-29: "link efficiency").
NO_SWING = "none"


@dataclass(frozen=True)
class Interval:
    """A prediction at the expected inputs, with the step and efficiency at both ends."""

    expected: Prediction
    step_low_s: float
    step_high_s: float
    dominant: str
    swings: dict

    @property
    def efficiency_low(self) -> float:
        return self.expected.efficiency * self.expected.step_s / self.step_high_s

    @property
    def efficiency_high(self) -> float:
        return self.expected.efficiency * self.expected.step_s / self.step_low_s


def _pinned(t: Transport, which: str) -> Transport:
    """``t`` with one input's range collapsed to its expected value (``which`` stays free)."""
    e, p = t.efficiency, t.per_message
    if which != "link efficiency":
        e = (e[1], e[1], e[1])
    if which != "per-message cost":
        p = (p[1], p[1], p[1])
    return replace(t, efficiency=e, per_message=p)


def predict_interval(workload: Workload, topo: Topology, world: int, strategy: Strategy,
                     options: PlanOptions | None = None) -> Interval | None:
    """The prediction at expected inputs and its range (``None`` where the strategy cannot run)."""
    options = options or PlanOptions()
    mid = predict(workload, topo, world, strategy, replace(options, bound="expected"))
    if mid is None:
        return None
    low = predict(workload, topo, world, strategy, replace(options, bound="optimistic"))
    high = predict(workload, topo, world, strategy, replace(options, bound="pessimistic"))
    assert low is not None and high is not None
    swings = {name: _swing(workload, topo, world, strategy, options, name) - mid.step_s
              for name in INPUTS}
    dominant = max(swings, key=lambda k: swings[k])
    if not swings[dominant] > 1e-9 * mid.step_s:  # nothing swings (one GPU; literal links...)
        dominant = NO_SWING
    return Interval(mid, min(low.step_s, mid.step_s), max(high.step_s, mid.step_s), dominant,
                    swings)


def _swing(workload: Workload, topo: Topology, world: int, strategy: Strategy,
           options: PlanOptions, which: str) -> float:
    """The step with only ``which`` at its pessimistic end."""
    table = {name: _pinned(t, which) for name, t in (options.transports or TRANSPORTS).items()}
    cv = options.step_cv
    if which != "step-time spread" and cv is None:
        cv = workload.step_cv if workload.step_cv is not None else options.default_cv[1]
    p = predict(workload, topo, world, strategy,
                replace(options, bound="pessimistic", step_cv=cv, transports=table))
    assert p is not None
    return p.step_s

