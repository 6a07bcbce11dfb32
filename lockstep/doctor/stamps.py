"""Timestamps that cost nothing on the critical path: the CPU clock, or CUDA events.

On the CPU a mark is ``time.perf_counter()``. On CUDA the work of a phase is still queued when
the Python call returns, so the mark is a CUDA event recorded on the current stream, turned into
seconds later (when the step is long finished) instead of ``torch.cuda.synchronize()`` at every
mark, which would stall the queue and change what is measured.
"""

from __future__ import annotations

import time
from typing import Any, Union

import torch

__all__ = ["Stamp", "Stamps"]

Stamp = Union[float, "torch.cuda.Event"]


class Stamps:
    """Makes marks for ``device`` and resolves them to ``time.perf_counter`` seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._device = device
        self._base: Any = None
        self._base_cpu = 0.0
        if self.cuda:
            # One synchronisation, once: the event clock's zero is this CPU instant.
            with torch.cuda.device(device):
                torch.cuda.synchronize()
                self._base = torch.cuda.Event(enable_timing=True)
                self._base.record(torch.cuda.current_stream(device))
                self._base.synchronize()
            self._base_cpu = time.perf_counter()

    def now(self) -> Stamp:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        # On this device's stream, whichever device is current (no synchronisation here).
        event.record(torch.cuda.current_stream(self._device))
        return event

    def done(self, stamp: Stamp) -> bool:
        """Whether ``stamp`` can be resolved without waiting."""
        return isinstance(stamp, float) or bool(stamp.query())

    def resolve(self, stamp: Stamp, wait: bool = False) -> float:
        """Seconds on the ``time.perf_counter`` clock (waits for the event if ``wait``)."""
        if isinstance(stamp, float):
            return stamp
        if wait:
            stamp.synchronize()
        return self._base_cpu + self._base.elapsed_time(stamp) / 1e3
