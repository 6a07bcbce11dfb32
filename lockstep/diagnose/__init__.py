"""Hang detection: a collective that a peer never joins, or joins with another call, names that peer.

- :mod:`~lockstep.diagnose.progress`: each rank's progress record (step, phase, collectives
  entered per group), published to the job's store by a daemon thread; ``default_store()``,
  the one way lockstep reaches that store (None without a group).
- :mod:`~lockstep.diagnose.hang`: waiting on a collective; when the backend gives up, the
  peers' records name who did not arrive (stuck, gone, exited, late): ``CollectiveTimeoutError``.
- :mod:`~lockstep.diagnose.blame`: watching the peers' heartbeats, and the blame file that
  ``lockstep run`` reads to report the rank that stopped, not the ones that waited.
- :mod:`~lockstep.diagnose.stackdump`: a stuck rank's Python stack on ``SIGUSR1``, shown beside
  its name.
- :mod:`~lockstep.diagnose.abort_guard`: a rank that gloo aborts for a collective mismatch
  names the rank that skipped a collective and exits 1.
- :mod:`~lockstep.diagnose.collective_checks`: debug mode (``LOCKSTEP_DEBUG_COLLECTIVES=1``),
  every rank's next collective compared before it runs: ``CollectiveMismatchError``.
- :mod:`~lockstep.diagnose.watchdog`: ``CollectiveWatchdog``, user-facing collectives with
  their own timeout.

The one seam other layers use: a component counts its collectives on a group with a
:class:`~lockstep.diagnose.progress.GroupProgress` (``GroupProgress(group)`` once, or
``group_progress(group)`` on a hot path) and waits for them through
:func:`hang.wait <lockstep.diagnose.hang.wait>` (a future), :func:`hang.run
<lockstep.diagnose.hang.run>` (a blocking call) or :func:`hang.call_as
<lockstep.diagnose.hang.call_as>` (a call on behalf of a counted collective). The records,
heartbeats, stack dumps, blame file and abort guard stay behind it. This package sits under
the collectives (``lockstep.distributed`` starts the tracker) and imports only the base layer.

Public names and submodules are imported on first access: ``lockstep.distributed`` imports
:mod:`~lockstep.diagnose.progress` without loading the watchdog or the abort guard.
"""

from __future__ import annotations

from lockstep.lazy import lazy_getattr

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CollectiveMismatchError": "lockstep.diagnose.collective_checks",
    "CollectiveTimeoutError": "lockstep.diagnose.hang",
    "CollectiveWatchdog": "lockstep.diagnose.watchdog",
    "GroupProgress": "lockstep.diagnose.progress",
    "LocalUsageError": "lockstep.diagnose.hang",
    "check_collective": "lockstep.diagnose.collective_checks",
    "debug_collectives_enabled": "lockstep.diagnose.collective_checks",
    "default_store": "lockstep.diagnose.progress",
    "group_progress": "lockstep.diagnose.progress",
}

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollectiveWatchdog",
    "GroupProgress",
    "LocalUsageError",
    "check_collective",
    "debug_collectives_enabled",
    "default_store",
    "group_progress",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
