"""Former home of the SIGABRT guard (names the rank that skipped a collective), kept for older imports.

It now lives in :mod:`lockstep.diagnose.abort_guard` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.abort_guard import AbortGuard, CollectiveMismatchAbort, odd_counts

__all__ = ["AbortGuard", "CollectiveMismatchAbort", "odd_counts"]
