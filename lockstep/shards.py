"""Which tensors are one rank's own: ``fully_shard``'s shards, a pipeline stage's parameters.

A base-layer home for the marks, so that code below the layers that set them (local SGD, which
must refuse shards; the Checkpointer, which must not save them from rank 0 alone) can ask
without importing :mod:`lockstep.fsdp` or :mod:`lockstep.pipeline`.
"""

from __future__ import annotations

__all__ = ["is_shard", "mark_shard", "mark_stage_param", "stage_param_of"]

_SHARD_ATTR = "_lockstep_fsdp_shard"
_STAGE_ATTR = "_lockstep_pipeline_stage"


def mark_shard(param: object) -> None:
    """Record that ``param`` is one rank's shard of a parameter (what its optimizer steps)."""
    setattr(param, _SHARD_ATTR, True)


def is_shard(tensor: object) -> bool:
    """Whether ``tensor`` is a shard made by ``fully_shard`` (see :func:`mark_shard`)."""
    return bool(getattr(tensor, _SHARD_ATTR, False))


def mark_stage_param(param: object, stage: int) -> None:
    """Record that ``param`` belongs to stage ``stage`` of a pipeline over ranks (this rank's)."""
    setattr(param, _STAGE_ATTR, stage)


def stage_param_of(tensor: object) -> int | None:
    """The pipeline stage ``tensor`` is a parameter of (see :func:`mark_stage_param`), or None."""
    stage = getattr(tensor, _STAGE_ATTR, None)
    return stage if isinstance(stage, int) else None
