"""Former home of :func:`lockstep.spawn`, kept so that older imports keep working.

Starting a world from Python now lives beside the launcher, in :mod:`lockstep.launcher.spawn`.
"""

from lockstep.launcher.spawn import WorkerError, find_free_port, spawn

__all__ = ["WorkerError", "find_free_port", "spawn"]
