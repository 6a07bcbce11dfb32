"""DistributedDataParallel: buckets (bucket.py), the reducer (reducer.py) with its bucket layout
(bucket_layout.py), bucket launches (bucket_launch.py) and unused-parameter search (unused.py),
comm hooks (lockstep.comm.hooks), start-up agreement (replica_sync.py), constructor checks (arguments.py),
delayed all-reduce (delayed.py), uneven inputs (join.py), profiling (profiling.py, observer.py,
arrivals.py; timing.py only re-exports), the wrapper module (wrapper.py); the same run at any
world size: virtual shards (virtual_shards.py) summed in a fixed tree (shard_tree.py)."""

from lockstep.comm.hooks import GradBucket, allreduce_hook
from lockstep.ddp.replica_sync import ReplicaMismatchError
from lockstep.ddp.virtual_shards import VirtualShardDDP, split_shards
from lockstep.ddp.wrapper import DistributedDataParallel
from lockstep.profilers import StepTiming

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "ReplicaMismatchError",
    "StepTiming",
    "VirtualShardDDP",
    "allreduce_hook",
    "split_shards",
]
