"""Kept for existing imports: the comm-hook interface now lives in :mod:`lockstep.comm.hooks`.

It sits under both ``lockstep.ddp`` (which calls hooks) and the hooks of ``lockstep.comm``, so
neither imports the other's internals. lockstep itself imports :mod:`lockstep.comm.hooks`.
"""

from lockstep.comm.hooks import (
    CommHook,
    GradBucket,
    allreduce_hook,
    check_annotations,
    completed_future,
    returns_future,
)

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "check_annotations", "completed_future",
           "returns_future"]
