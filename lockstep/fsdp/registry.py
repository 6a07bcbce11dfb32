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

__all__ = ["attach", "get_unit", "is_shard", "is_sharded", "mark_shard", "owner_of", "set_owner"]

_ATTR = "_lockstep_fsdp_unit"
_OWNER_ATTR = "_lockstep_fsdp_owner"
_REPLACED_ATTR = "_lockstep_fsdp_replaced_by"


class _Owner:
    """The unit a shard belongs to, held on the shard. A copy or a pickle of the shard (a
    ``torch.save`` of the parameter itself) carries no unit: it is no longer that unit's."""

    __slots__ = ("unit",)

    def __init__(self, unit: FSDPUnit | None = None) -> None:
        self.unit = unit

    def __reduce__(self) -> tuple:
        return (_Owner, ())

    def __deepcopy__(self, memo: dict) -> _Owner:
        return _Owner()


def attach(module: nn.Module, unit: FSDPUnit) -> None:
    """Record ``unit`` as the sharding state of ``module``."""
    module.__dict__[_ATTR] = unit


def get_unit(module: nn.Module) -> FSDPUnit | None:
    """The unit ``fully_shard`` made of ``module``, or ``None``."""
    return module.__dict__.get(_ATTR)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is a ``fully_shard`` unit."""
    return any(get_unit(m) is not None for m in model.modules())


def set_owner(shard: object, unit: FSDPUnit) -> None:
    """Record that ``shard`` is a parameter of ``unit`` (its shard group, for global norms)."""
    setattr(shard, _OWNER_ATTR, _Owner(unit))


def owner_of(tensor: object) -> FSDPUnit | None:
    """The unit whose shard ``tensor`` is (:func:`set_owner`), or ``None``."""
    owner = getattr(tensor, _OWNER_ATTR, None)
    return owner.unit if isinstance(owner, _Owner) else None


def mark_replaced(original: object, unit: FSDPUnit) -> None:
    """Record that ``unit`` replaced the parameter ``original`` with a shard: another module
    that still holds it (a tied weight) shares it with that unit."""
    setattr(original, _REPLACED_ATTR, _Owner(unit))


def replaced_by(tensor: object) -> FSDPUnit | None:
    """The unit that sharded ``tensor`` away (:func:`mark_replaced`), or ``None``."""
    owner = getattr(tensor, _REPLACED_ATTR, None)
    return owner.unit if isinstance(owner, _Owner) else None
