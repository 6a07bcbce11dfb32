"""Ranks as a checkpoint numbers them: ranks of the Checkpointer's process group, not global ones.

The Checkpointer names each rank's shard file by its rank in its own ``process_group``
(``shard-rank00001.pt`` is that group's rank 1), and ``state.pt`` is written by that group's
rank 0. So a sharded model records, for each chunk of a parameter, the *checkpoint* rank that
holds it, and the rank that writes the buffers is the group's rank 0, not global rank 0. With
the default group the two numberings agree; with a group of its own (a model sharded over
global ranks 2 and 3) they do not, and mixing them looks up files that were never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.fsdp.unit import get_unit

__all__ = ["checkpoint_group_ranks", "to_checkpoint_ranks"]


def _model_group(model: nn.Module) -> Any:
    """The group a model without replicas is sharded over (``None``: the default group)."""
    units = [unit for module in model.modules() if (unit := get_unit(module)) is not None]
    if not units or any(unit.replicate_group is not None for unit in units):
        return None  # plain, or hybrid: its replicas and shards together span the default group
    groups = {id(unit.shard_group): unit.shard_group for unit in units}
    return next(iter(groups.values())) if len(groups) == 1 else None


def checkpoint_group_ranks(model: nn.Module, process_group: Any = None) -> list[int]:
    """The global ranks of the group that saves ``model``, in its rank order.

    Args:
        model: the (sharded or plain) model.
        process_group: the Checkpointer's ``process_group``; ``None``: the group ``model`` is
            sharded over when it has no replicas, else the default group.
    """
    if not dist.is_initialized():
        return [0]
    group = process_group if process_group is not None else _model_group(model)
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def to_checkpoint_ranks(ranks: Sequence[int], global_ranks: Sequence[int], what: str) -> tuple[int, ...]:
    """``global_ranks`` as ranks of the checkpoint group ``ranks``; ValueError if one is outside it."""
    outside = [g for g in global_ranks if g not in ranks]
    if outside:
        raise ValueError(
            f"{what}: global rank(s) {outside} hold shards of this model but are not in the "
            f"checkpoint's process group (global ranks {list(ranks)}); pass the Checkpointer's "
            "group as ModelState(model, process_group=...) and OptimizerState(..., process_group=...)"
        )
    return tuple(ranks.index(g) for g in global_ranks)
