"""Step timing, kept for existing imports: it now lives in :mod:`lockstep.doctor`.

``DistributedDataParallel.enable_step_timing()`` is ``enable_profiling()``; the reducer's clock
is the doctor's :class:`~lockstep.doctor.recorder.Recorder`.
"""

from __future__ import annotations

from lockstep.doctor.recorder import Recorder as StepClock
from lockstep.doctor.records import StepTiming

__all__ = ["StepTiming", "StepClock"]
