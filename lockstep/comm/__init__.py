"""Comm hooks that send fewer bytes, and local SGD that sends less often.

- :mod:`~lockstep.comm.hooks`: the comm-hook interface (``GradBucket``, the default all-reduce
  hook) that DDP calls and every hook here implements; below both, so neither imports the other.
- :mod:`~lockstep.comm.compression`: fp16/bf16 all-reduce (half the bytes); the uncompressed
  baseline; DDP's ``mixed_precision`` reduction in another dtype.
- :mod:`~lockstep.comm.fp32_accumulate`: bf16 on the wire, the mean added up in fp32 (DDP's
  ``reduce_dtype=``): bf16's bytes without its drift at many ranks.
- :mod:`~lockstep.comm.powersgd`: rank-r PowerSGD with error feedback (tens of times fewer).
- :mod:`~lockstep.comm.local_sgd`: local SGD / DiLoCo (one merge every H steps).
- :mod:`~lockstep.comm.state`: the byte counter every hook fills.
"""

from lockstep.comm.compression import (
    ReduceDtypeState,
    bf16_compress_hook,
    compress_hook,
    fp16_compress_hook,
    reduce_dtype_hook,
    uncompressed_hook,
)
from lockstep.comm.fp32_accumulate import (
    FP32AccumulateState,
    bf16_fp32_accumulate_hook,
    fp32_accumulate_hook,
    fp32_accumulated_mean,
)
from lockstep.comm.hooks import GradBucket
from lockstep.comm.local_sgd import LocalSGD, local_gradients_hook
from lockstep.comm.powersgd import PowerSGDState, powersgd_hook
from lockstep.comm.state import ByteCounter, CommState

__all__ = [
    "ByteCounter",
    "CommState",
    "FP32AccumulateState",
    "GradBucket",
    "LocalSGD",
    "PowerSGDState",
    "ReduceDtypeState",
    "bf16_compress_hook",
    "bf16_fp32_accumulate_hook",
    "compress_hook",
    "fp16_compress_hook",
    "fp32_accumulate_hook",
    "fp32_accumulated_mean",
    "local_gradients_hook",
    "powersgd_hook",
    "reduce_dtype_hook",
    "uncompressed_hook",
]
