"""Who records a model that asks to be profiled: the one seam between the wrappers and the doctor.

:class:`lockstep.DistributedDataParallel` and :class:`lockstep.DataParallel` sit below the
doctor (docs/contributing.md, "Layers") and never import it, yet ``enable_profiling()`` returns
the doctor's recorder and every DDP records when ``LOCKSTEP_PROFILE`` is set. They ask this
module, and the doctor answers: ``lockstep/__init__.py`` registers it (Python runs that file
before any lockstep module, so it is always registered), as a loader that imports the doctor
only when a model first asks. The wrappers then talk to the recorder through their observer
protocols (``lockstep/ddp/observer.py``, ``lockstep/dp/observer.py``), as torch's DDP calls a
comm hook it was handed instead of importing a profiler.

The registration is the only state here: one loader, replaced with :func:`register` (which
returns the previous one, so a test can put it back). :class:`StepTiming`, the one record that
comes back through DDP's own API (``step_timings``), lives here too, so that neither side
imports the other for it. Standard library only: ``import lockstep`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Profilers", "StepTiming", "current", "register"]


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent in one iteration's forward, backward, and exposed communication.

    ``backward_s`` runs from the first gradient produced to the end of the reduction, so it
    includes ``exposed_comm_s``. (Kept for :meth:`DistributedDataParallel.step_timings`.)
    """

    forward_s: float
    backward_s: float
    exposed_comm_s: float

    @property
    def exposed_share(self) -> float:
        total = self.forward_s + self.backward_s
        return self.exposed_comm_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Profilers:
    """What the wrappers ask for (the doctor's answers are in ``lockstep/__init__.py``).

    Attributes:
        ddp: builds DDP's recorder, a :class:`lockstep.ddp.observer.StepObserver`, from
            ``(device, params, group, layout, model_info, out_dir, max_steps, warmup,
            gather_every)`` (the doctor's :class:`~lockstep.doctor.recorder.Recorder`).
        dp: builds DataParallel's recorder, a :class:`lockstep.dp.observer.DataParallelObserver`,
            from ``(params, devices, warmup)``.
        settings_from_env: ``enable_profiling`` keyword arguments the environment asks every
            DDP for (``LOCKSTEP_PROFILE``, set by ``lockstep doctor``), or None.
    """

    ddp: Callable[..., Any]
    dp: Callable[..., Any]
    settings_from_env: Callable[[], dict[str, Any] | None]


Loader = Callable[[], Profilers]

_loader: Loader | None = None


def register(loader: Loader) -> Loader | None:
    """Make ``loader`` the source of recorders; returns the one it replaces (None: none was set)."""
    global _loader
    if not callable(loader):
        raise TypeError(f"lockstep.profilers.register needs a callable returning Profilers, "
                        f"got {type(loader).__name__}")
    previous, _loader = _loader, loader
    return previous


def current() -> Profilers:
    """The registered :class:`Profilers` (the doctor's, unless a test registered others).

    Raises:
        RuntimeError: nothing is registered (``import lockstep`` registers the doctor).
    """
    if _loader is None:
        raise RuntimeError(
            "no profiler is registered: importing lockstep registers lockstep doctor's "
            "(lockstep/__init__.py); lockstep.profilers.register(loader) registers another"
        )
    return _loader()
