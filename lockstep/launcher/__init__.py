"""``lockstep run``: start a training script on N workers per machine, on torch.distributed.elastic.

- :mod:`~lockstep.launcher.flags`: torchrun's command-line flags.
- :mod:`~lockstep.launcher.plan`: the flags validated into a ``LaunchPlan`` (which checks itself
  however it is built) and the elastic ``LaunchConfig`` made from it.
- :mod:`~lockstep.launcher.worker_env`: the environment workers get (threads, loopback gloo).
- :mod:`~lockstep.launcher.rendezvous`: torch's c10d rendezvous; restart-safe, loopback-only
  on one machine.
- :mod:`~lockstep.launcher.worker`: what each worker runs (the script, with its traceback recorded).
- :mod:`~lockstep.launcher.output`: workers' output on the console, prefixed with their rank.
- :mod:`~lockstep.launcher.errors`: the root cause of a failed job.
- :mod:`~lockstep.launcher.run`: the launch itself and its exit status.
- :mod:`~lockstep.launcher.spawn`: starting a world from Python (``lockstep.spawn``).

Submodules are imported on use so that a worker importing :mod:`lockstep.launcher.worker`
does not load the launcher.
"""

__all__: list[str] = []
