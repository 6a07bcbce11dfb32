"""Where the time of a step went: forward, backward, and communication left exposed.

"Exposed" communication is the time spent at the end of backward waiting for all-reduces that
backward could not hide. It answers "why is my speedup only 1.3x?": a large exposed share means
the links, not the compute, bound the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["StepTiming", "StepClock"]


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent in one iteration's forward, backward, and exposed communication.

    ``backward_s`` runs from the first gradient produced to the end of the reduction, so it
    includes ``exposed_comm_s``.
    """

    forward_s: float
    backward_s: float
    exposed_comm_s: float

    @property
    def exposed_share(self) -> float:
        total = self.forward_s + self.backward_s
        return self.exposed_comm_s / total if total > 0 else 0.0


class StepClock:
    """Collects :class:`StepTiming` per iteration; synchronises CUDA so times are real."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.history: list[StepTiming] = []
        self._forward_start = self._forward_s = 0.0
        self._backward_start: float | None = None
        self._exposed_s = 0.0

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def forward_started(self) -> None:
        self._forward_start = self.now()
        self._backward_start = None
        self._exposed_s = 0.0

    def forward_ended(self) -> None:
        self._forward_s = self.now() - self._forward_start

    def backward_started(self) -> None:
        if self._backward_start is None:
            self._backward_start = self.now()

    def add_exposed(self, seconds: float) -> None:
        self._exposed_s += seconds

    def backward_ended(self) -> None:
        start = self._backward_start if self._backward_start is not None else self.now()
        self.history.append(StepTiming(self._forward_s, self.now() - start, self._exposed_s))
        self._backward_start = None
