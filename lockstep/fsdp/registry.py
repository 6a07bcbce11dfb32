"""Which modules are fully sharded units: the one attribute ``fully_shard`` sets on a module.

Its own module so that ``prefetch`` (which ``unit`` imports) can find the units under a model
without importing ``unit`` back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lockstep.fsdp.unit import FSDPUnit

__all__ = ["attach", "get_unit", "is_shard", "is_sharded", "mark_shard"]

_ATTR = "_lockstep_fsdp_unit"
_SHARD_ATTR = "_lockstep_fsdp_shard"


def attach(module: nn.Module, unit: FSDPUnit) -> None:
    """Record ``unit`` as the sharding state of ``module``."""
    module.__dict__[_ATTR] = unit


def get_unit(module: nn.Module) -> FSDPUnit | None:
    """The unit ``fully_shard`` made of ``module``, or ``None``."""
    return module.__dict__.get(_ATTR)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is a ``fully_shard`` unit."""
    return any(get_unit(m) is not None for m in model.modules())


def mark_shard(param: nn.Parameter) -> None:
    """Record that ``param`` is one rank's shard of a parameter (what its optimizer steps)."""
    setattr(param, _SHARD_ATTR, True)


def is_shard(tensor: object) -> bool:
    """Whether ``tensor`` is a shard made by ``fully_shard`` (see :func:`mark_shard`)."""
    return bool(getattr(tensor, _SHARD_ATTR, False))
