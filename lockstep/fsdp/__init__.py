"""Fully sharded data parallelism (ZeRO-3) and hybrid sharding.

``flat_param`` lays a unit's parameters out as 1/N shards and gathers them back, ``unit`` holds
the forward/backward hooks that gather, free and reduce-scatter, ``prefetch`` starts the next
unit's gather early, ``registry`` marks which modules are units, ``checkpoint`` saves and restores through the Checkpointer, ``collectives`` is the one home
of the collectives gloo may lack, ``mixed_precision`` the policy, ``agreement``
the options every rank must give alike, and ``api`` ties them into
:func:`lockstep.fully_shard`. Papers: Rajbhandari et al., "ZeRO" (2020, stage 3); Zhao et al.,
"PyTorch FSDP" (2023).
"""

from lockstep.fsdp.api import (
    UnshardHandle,
    clip_grad_norm_,
    full_state_dict,
    fully_shard,
    mesh_groups,
    no_sync,
    reshard,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from lockstep.fsdp.checkpoint import ModelState, OptimizerState
from lockstep.fsdp.mixed_precision import MixedPrecisionPolicy
from lockstep.fsdp.prefetch import record_events, set_prefetch

__all__ = [
    "MixedPrecisionPolicy",
    "ModelState",
    "OptimizerState",
    "UnshardHandle",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "mesh_groups",
    "no_sync",
    "record_events",
    "reshard",
    "set_prefetch",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "unshard",
]
