"""lockstep: data-parallel training for PyTorch.

Public names are imported lazily, so ``import lockstep`` stays cheap and a launcher process
never imports the training machinery it does not use.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "CollectiveWatchdog": "lockstep.watchdog",
    "CollectiveTimeoutError": "lockstep.watchdog",
    "CollectiveMismatchError": "lockstep.collective_checks",
    "check_collective": "lockstep.collective_checks",
    "DataParallel": "lockstep.dp.data_parallel",
    "Pipeline": "lockstep.pipeline.pipe",
    "Checkpointer": "lockstep.checkpoint",
    "CheckpointError": "lockstep.checkpoint",
    "Restored": "lockstep.checkpoint",
    "load_weights": "lockstep.checkpoint",
    "Runtime": "lockstep.helper.runtime",
    "ZeroRedundancyOptimizer": "lockstep.zero.optimizer",
    "DistributedSampler": "lockstep.sampler",
    "ProcessInfo": "lockstep.env",
    "init_distributed": "lockstep.distributed",
    "shutdown_distributed": "lockstep.distributed",
    "spawn": "lockstep.multiproc",
    "WorkerError": "lockstep.multiproc",
    "DistributedDataParallel": "lockstep.ddp.wrapper",
    "GradBucket": "lockstep.ddp.comm_hooks",
    "profile": "lockstep.doctor.api",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
