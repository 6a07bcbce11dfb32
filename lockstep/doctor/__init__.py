"""lockstep doctor: why a data-parallel job is slower than N times one worker.

Recording (``recorder.py``, ``records.py``, ``stamps.py``, ``env.py``) runs inside every rank;
the analysis (``profile_file.py`` builds ``profile.json``, ``attribution.py`` names stragglers,
bandwidth and exposed buckets, ``account.py`` turns world 1 vs world N into a speedup account
and actions) and the pictures (``render.py``: PNG timeline and Chrome trace) run anywhere on
the saved files; ``command.py`` is ``lockstep doctor``. ``dp_vs_ddp.py`` runs one model under
DataParallel and under DDP and ``dp_report.py`` says what DDP would save.
"""

from __future__ import annotations

from lockstep.doctor.api import gather_report, profile
from lockstep.doctor.dp_report import DPvsDDP
from lockstep.doctor.dp_vs_ddp import compare_dp_ddp
from lockstep.doctor.recorder import Recorder
from lockstep.doctor.records import StepTiming

__all__ = ["DPvsDDP", "Recorder", "StepTiming", "compare_dp_ddp", "gather_report", "profile"]
