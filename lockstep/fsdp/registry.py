"""Which modules are fully sharded units: the one attribute ``fully_shard`` sets on a module.

Its own module so that ``prefetch`` (which ``unit`` imports) can find the units under a model
without importing ``unit`` back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lockstep.shards import is_shard, mark_shard  # the mark's home (base layer); re-exported

if TYPE_CHECKING:
    from lockstep.fsdp.unit import FSDPUnit

__all__ = ["attach", "get_unit", "is_shard", "is_sharded", "mark_shard"]

_ATTR = "_lockstep_fsdp_unit"


def attach(module: nn.Module, unit: FSDPUnit) -> None:
    """Record ``unit`` as the sharding state of ``module``."""
    module.__dict__[_ATTR] = unit


def get_unit(module: nn.Module) -> FSDPUnit | None:
    """The unit ``fully_shard`` made of ``module``, or ``None``."""
    return module.__dict__.get(_ATTR)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is a ``fully_shard`` unit."""
    return any(get_unit(m) is not None for m in model.modules())
