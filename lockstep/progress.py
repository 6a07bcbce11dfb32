"""Former home of the progress records and their tracker, kept for older imports.

It now lives in :mod:`lockstep.diagnose.progress` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.progress import (
    INTERVAL_ENV_VAR,
    GroupProgress,
    ProgressTracker,
    close_tracker,
    default_store,
    group_key,
    group_progress,
    publish_interval,
    record_key,
    tracker,
)

__all__ = [
    "INTERVAL_ENV_VAR",
    "GroupProgress",
    "ProgressTracker",
    "close_tracker",
    "default_store",
    "group_key",
    "group_progress",
    "publish_interval",
    "record_key",
    "tracker",
]
