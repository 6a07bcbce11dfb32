"""Which tensors are one rank's shard of a parameter: the mark ``fully_shard`` sets on them.

A base-layer home for it, so that code below the sharding layer (local SGD, which must refuse
shards) can ask without importing :mod:`lockstep.fsdp`.
"""

from __future__ import annotations

__all__ = ["is_shard", "mark_shard"]

_SHARD_ATTR = "_lockstep_fsdp_shard"


def mark_shard(param: object) -> None:
    """Record that ``param`` is one rank's shard of a parameter (what its optimizer steps)."""
    setattr(param, _SHARD_ATTR, True)


def is_shard(tensor: object) -> bool:
    """Whether ``tensor`` is a shard made by ``fully_shard`` (see :func:`mark_shard`)."""
    return bool(getattr(tensor, _SHARD_ATTR, False))
