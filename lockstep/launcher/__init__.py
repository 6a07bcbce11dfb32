"""``lockstep run``: start a training script on N workers per machine, on torch.distributed.elastic.

- :mod:`~lockstep.launcher.config`: torchrun's flags, validated into an elastic ``LaunchConfig``.
- :mod:`~lockstep.launcher.rendezvous`: torch's c10d rendezvous; restart-safe, loopback-only
  on one machine.
- :mod:`~lockstep.launcher.worker`: what each worker runs (the script, with its traceback recorded).
- :mod:`~lockstep.launcher.output`: workers' output on the console, prefixed with their rank.
- :mod:`~lockstep.launcher.errors`: the root cause of a failed job.
- :mod:`~lockstep.launcher.run`: the launch itself and its exit status.

Submodules are imported on use so that a worker importing :mod:`lockstep.launcher.worker`
does not load the launcher.
"""

__all__: list[str] = []
