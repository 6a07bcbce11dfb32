"""``lockstep run``: start a training script on N workers per machine, on torch.distributed.elastic.

- :mod:`~lockstep.launcher.flags`: torchrun's command-line flags.
- :mod:`~lockstep.launcher.launch_plan`: the flags validated into a ``LaunchPlan`` (which
  checks itself however it is built) and the elastic ``LaunchConfig`` made from it.
- :mod:`~lockstep.launcher.worker_env`: the environment workers get (threads, loopback gloo).
- :mod:`~lockstep.launcher.rendezvous`: torch's c10d rendezvous; restart-safe, loopback-only
  on one machine, the store's host leaving last.
- :mod:`~lockstep.launcher.stores`: the stores machines meet through (loopback, or hosted by
  the machine that owns the endpoint's address).
- :mod:`~lockstep.launcher.rendezvous_report`: what the rendezvous says while waiting, at its
  timeout, and when machines join or leave.
- :mod:`~lockstep.launcher.worker`: what each worker runs (the script, with its traceback recorded).
- :mod:`~lockstep.launcher.output`: workers' output on the console, prefixed with their rank.
- :mod:`~lockstep.launcher.errors`: the root cause of a failed job.
- :mod:`~lockstep.launcher.run`: the launch itself and its exit status.
- :mod:`~lockstep.launcher.spawn`: starting a world from Python (``lockstep.spawn``).

Public names (:func:`launch`, :class:`LaunchPlan`) and submodules are imported on first access,
so that a worker importing :mod:`lockstep.launcher.worker` does not load the launcher.
"""

from __future__ import annotations

from lockstep.lazy import lazy_getattr

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LaunchPlan": "lockstep.launcher.launch_plan",
    "launch": "lockstep.launcher.run",
    "spawn": "lockstep.launcher.spawn",
    "WorkerError": "lockstep.launcher.spawn",
}

__all__ = ["LaunchPlan", "WorkerError", "launch", "spawn"]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
