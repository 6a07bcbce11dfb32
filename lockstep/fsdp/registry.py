"""Which modules are fully sharded units: the one attribute ``fully_shard`` sets on a module.

Its own module so that ``prefetch`` (which ``unit`` imports) can find the units under a model
without importing ``unit`` back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lockstep.fsdp.unit import FSDPUnit

__all__ = ["attach", "get_unit"]

_ATTR = "_lockstep_fsdp_unit"


def attach(module: nn.Module, unit: FSDPUnit) -> None:
    """Record ``unit`` as the sharding state of ``module``."""
    module.__dict__[_ATTR] = unit


def get_unit(module: nn.Module) -> FSDPUnit | None:
    """The unit ``fully_shard`` made of ``module``, or ``None``."""
    return module.__dict__.get(_ATTR)
