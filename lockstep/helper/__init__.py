"""A small training helper: device, model wrapping, sharded loaders, rank-0 output, metrics.

Every piece is optional and usable alone: :class:`Runtime` bundles them for a script, while
:mod:`lockstep.helper.loader` and :mod:`lockstep.helper.collectives` work without it.
"""

from __future__ import annotations

from lockstep.helper.collectives import all_reduce_metrics, gather_for_eval
from lockstep.helper.loader import ShardedLoader, move_to_device, seed_worker
from lockstep.helper.runtime import Runtime

__all__ = [
    "Runtime",
    "ShardedLoader",
    "all_reduce_metrics",
    "gather_for_eval",
    "move_to_device",
    "seed_worker",
]
