"""Kept for existing imports: the profiling environment now lives in
:mod:`lockstep.doctor.profile_env` (renamed so that it no longer shares a name with
:mod:`lockstep.env`, which says who a process is). lockstep itself imports the new name.
"""

from lockstep.doctor.profile_env import (
    EVERY_ENV,
    PROFILE_ENV,
    STEPS_ENV,
    WARMUP_ENV,
    profiling_requested,
    settings_from_env,
)

__all__ = [
    "EVERY_ENV",
    "PROFILE_ENV",
    "STEPS_ENV",
    "WARMUP_ENV",
    "profiling_requested",
    "settings_from_env",
]
