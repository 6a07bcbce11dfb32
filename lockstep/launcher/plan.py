"""Former home of the launch plan, kept so that older imports keep working.

It now lives in :mod:`lockstep.launcher.launch_plan` (``lockstep run``'s arguments validated
into a :class:`~lockstep.launcher.launch_plan.LaunchPlan`, and the elastic config made from
it), named apart from the planner, :mod:`lockstep.plan`.
"""

from __future__ import annotations

from lockstep.launcher.launch_plan import (
    DEFAULT_RDZV_PORT,
    LaunchPlan,
    auto_nproc,
    parse_endpoint,
    parse_nnodes,
    plan_from_args,
    to_launch_config,
)

__all__ = [
    "DEFAULT_RDZV_PORT",
    "LaunchPlan",
    "auto_nproc",
    "parse_endpoint",
    "parse_nnodes",
    "plan_from_args",
    "to_launch_config",
]
