"""Plan a run: predict step time, scaling efficiency and memory per GPU before renting GPUs.

See docs/plan.md for the cost model, its assumptions and its validation.
"""

from lockstep.plan.costs import Cost, collective
from lockstep.plan.links import PRESETS, Link, Topology, parse_link, parse_topology
from lockstep.plan.measure import LinkSweep, fit_alpha_beta, measure_link, measure_link_sweep
from lockstep.plan.memory import Memory, model_state_memory
from lockstep.plan.model import PlanOptions, Prediction, predict, simulate_buckets
from lockstep.plan.planner import Plan, plan
from lockstep.plan.strategies import Strategy, parse_strategies, parse_strategy
from lockstep.plan.workload import (
    Bucket,
    ProfileError,
    Workload,
    describe,
    load_profile,
)

__all__ = [
    "PRESETS",
    "Bucket",
    "Cost",
    "Link",
    "LinkSweep",
    "Memory",
    "Plan",
    "PlanOptions",
    "Prediction",
    "ProfileError",
    "Strategy",
    "Topology",
    "Workload",
    "collective",
    "describe",
    "fit_alpha_beta",
    "load_profile",
    "measure_link",
    "measure_link_sweep",
    "model_state_memory",
    "parse_link",
    "parse_strategies",
    "parse_strategy",
    "parse_topology",
    "plan",
    "predict",
    "simulate_buckets",
]
