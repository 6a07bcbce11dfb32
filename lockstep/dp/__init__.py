"""Single-process data parallelism: scatter, replicate, parallel apply, gather, and the wrapper.

Each step is its own module so that each can be read and tested alone; :class:`DataParallel`
chains them.
"""

from __future__ import annotations

from lockstep.dp.data_parallel import DataParallel
from lockstep.dp.parallel_apply import parallel_apply
from lockstep.dp.replicate import replicate
from lockstep.dp.scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["DataParallel", "gather", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]
