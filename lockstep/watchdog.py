"""Former home of the collective watchdog, kept for older imports.

It now lives in :mod:`lockstep.diagnose.watchdog` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.watchdog import CollectiveTimeoutError, CollectiveWatchdog

__all__ = ["CollectiveTimeoutError", "CollectiveWatchdog"]
