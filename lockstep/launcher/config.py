"""Former home of ``lockstep run``'s arguments, kept so that older imports keep working.

What it held now lives in modules named for what they do: :mod:`~lockstep.launcher.flags`
(the command-line flags), :mod:`~lockstep.launcher.launch_plan` (validating them into a
:class:`~lockstep.launcher.launch_plan.LaunchPlan` and the elastic config) and
:mod:`~lockstep.launcher.worker_env` (the environment workers get).
"""

from lockstep.launcher.flags import add_run_arguments
from lockstep.launcher.launch_plan import (
    DEFAULT_RDZV_PORT,
    LaunchPlan,
    auto_nproc,
    parse_endpoint,
    parse_nnodes,
    plan_from_args,
    to_launch_config,
)
from lockstep.launcher.worker_env import loopback_gloo, omp_threads

__all__ = [
    "DEFAULT_RDZV_PORT",
    "LaunchPlan",
    "add_run_arguments",
    "auto_nproc",
    "loopback_gloo",
    "omp_threads",
    "parse_endpoint",
    "parse_nnodes",
    "plan_from_args",
    "to_launch_config",
]
