"""DistributedDataParallel: buckets (bucket.py), the reducer (reducer.py), comm hooks
(comm_hooks.py), start-up agreement (replica_sync.py), step timing (timing.py), the wrapper
module (wrapper.py)."""

from lockstep.ddp.comm_hooks import GradBucket, allreduce_hook
from lockstep.ddp.timing import StepTiming
from lockstep.ddp.wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "StepTiming", "allreduce_hook"]
