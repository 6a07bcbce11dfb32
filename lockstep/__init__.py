"""lockstep: data-parallel training for PyTorch.

Public names are imported lazily, so ``import lockstep`` stays cheap and a launcher process
never imports the training machinery it does not use. One rule for reaching anything:

- ``lockstep.Name`` for the names in ``_EXPORTS`` below;
- ``lockstep.<submodule>`` for every module and subpackage of lockstep (``lockstep.helper``,
  ``lockstep.zero``...), imported on first access;
- ``lockstep.<subpackage>.Name`` / ``from lockstep.<subpackage> import Name`` for the public
  names each subpackage's ``__init__`` lists in its ``__all__``.
"""

from __future__ import annotations

import pkgutil

from lockstep import profilers as _profilers
from lockstep.lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> module that defines it (one line each; add yours in place).
_EXPORTS: dict[str, str] = {
    "fp16_compress_hook": "lockstep.comm.compression",
    "bf16_compress_hook": "lockstep.comm.compression",
    "CommState": "lockstep.comm.state",
    "PowerSGDState": "lockstep.comm.powersgd",
    "powersgd_hook": "lockstep.comm.powersgd",
    "LocalSGD": "lockstep.comm.local_sgd",
    "SyncBatchNorm": "lockstep.sync_batchnorm",
    "accumulate": "lockstep.accumulation",
    "CollectiveWatchdog": "lockstep.diagnose.watchdog",
    "CollectiveTimeoutError": "lockstep.diagnose.hang",
    "CollectiveMismatchError": "lockstep.diagnose.collective_checks",
    "check_collective": "lockstep.diagnose.collective_checks",
    "DataParallel": "lockstep.dp.data_parallel",
    "Pipeline": "lockstep.pipeline.pipe",
    "Checkpointer": "lockstep.checkpoint",
    "CheckpointError": "lockstep.checkpoint",
    "Restored": "lockstep.checkpoint",
    "Survivors": "lockstep.resilience",
    "load_weights": "lockstep.checkpoint",
    "Runtime": "lockstep.helper.runtime",
    "ZeroRedundancyOptimizer": "lockstep.zero.optimizer",
    "fully_shard": "lockstep.fsdp.api",
    "MixedPrecisionPolicy": "lockstep.fsdp.mixed_precision",
    "DistributedSampler": "lockstep.sampler",
    "VirtualShardDDP": "lockstep.ddp.virtual_shards",
    "VirtualShardSampler": "lockstep.virtual_sampler",
    "split_shards": "lockstep.ddp.virtual_shards",
    "ProcessInfo": "lockstep.env",
    "init_distributed": "lockstep.distributed",
    "shutdown_distributed": "lockstep.distributed",
    "spawn": "lockstep.launcher.spawn",
    "WorkerError": "lockstep.launcher.spawn",
    "DistributedDataParallel": "lockstep.ddp.wrapper",
    "GradBucket": "lockstep.comm.hooks",
    "ReplicaMismatchError": "lockstep.ddp.replica_sync",
    "profile": "lockstep.doctor.api",
}

__all__ = sorted(_EXPORTS) + ["__version__"]  # noqa: PLE0605 - built from the table above


def _submodules() -> list[str]:
    """The modules and subpackages reachable as ``lockstep.<name>`` (imported on first access)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def _doctor() -> _profilers.Profilers:
    """The doctor records the wrappers below it (lockstep/profilers.py), imported when one asks."""
    from lockstep.doctor.dp_recorder import DataParallelRecorder
    from lockstep.doctor.profile_env import settings_from_env
    from lockstep.doctor.recorder import Recorder

    return _profilers.Profilers(ddp=Recorder, dp=DataParallelRecorder,
                                settings_from_env=settings_from_env)


# Here because Python runs this file before any lockstep module: every DDP finds the doctor.
_profilers.register(_doctor)


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_submodules()))
