"""What DataParallel tells an observer of its forward: the seam the doctor's DP recorder plugs into.

:meth:`DataParallel.enable_profiling <lockstep.dp.data_parallel.DataParallel.enable_profiling>`
gets its recorder through :mod:`lockstep.profilers` (the doctor's
:class:`~lockstep.doctor.dp_recorder.DataParallelRecorder`) and calls only these methods, so
``lockstep.dp`` never imports the doctor (docs/contributing.md, "Layers"); backward and the
optimizer step the recorder times itself, through torch's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["DataParallelObserver"]


class DataParallelObserver(Protocol):
    """Marks of one DataParallel forward, in the order it makes them."""

    def forward_started(self) -> None: ...
    def mark(self, phase: str) -> None: ...
    def timed_call(self, device: int, call: Callable[..., Any]) -> Callable[..., Any]: ...
    def forward_ended(self, output: Any) -> None: ...
    def close(self) -> None: ...
