"""Former home of the collective waits that name a missing peer, kept for older imports.

It now lives in :mod:`lockstep.diagnose.hang` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.hang import (
    BLAME_FILE,
    CollectiveTimeoutError,
    Culprit,
    LocalUsageError,
    call_as,
    describe_missing,
    observe_peers,
    read_blame,
    run,
    wait,
    write_blame,
)

__all__ = [
    "BLAME_FILE",
    "CollectiveTimeoutError",
    "Culprit",
    "LocalUsageError",
    "call_as",
    "describe_missing",
    "observe_peers",
    "read_blame",
    "run",
    "wait",
    "write_blame",
]
