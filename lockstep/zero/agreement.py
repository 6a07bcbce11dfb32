"""Checks that every rank gave ZeroRedundancyOptimizer the same settings.

Each parameter is stepped by its owner only, with the owner's optimizer class and
hyperparameters, and then broadcast: ranks built with another ``lr`` (or another optimizer)
would step each shard with its owner's settings, silently (torch's ZeRO does). And a
consolidation whose target differs across ranks would leave each rank waiting for a gather
that the others run elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress

__all__ = ["Settings", "agree_on_target", "settings", "settings_mismatch"]

# (the optimizer class's qualified name, (group index, {hyperparameter: comparable value})...)
Settings = tuple[str, list[tuple[int, dict[str, Any]]]]

_UNSET = "<not set>"


def settings(optimizer_class: type, groups: list[dict[str, Any]], first: int = 0) -> Settings:
    """What must agree across ranks: the class and the hyperparameters of the groups from
    ``first`` on (``groups`` holds only hyperparameters, no ``params``)."""
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    return name, [(first + k, {key: _comparable(v) for key, v in group.items()})
                  for k, group in enumerate(groups)]


def settings_mismatch(everyone: list[Settings], ranks: list[int]) -> str | None:
    """The first setting the ranks disagree on, with each rank's value; ``None`` if none."""
    classes = [theirs[0] for theirs in everyone]
    if len(set(classes)) > 1:
        return (f"the ranks built it over different optimizer classes (optimizer_class: "
                f"{_by_value(classes, ranks)}); every parameter is stepped by its owner's "
                "optimizer, so pass the same optimizer_class on every rank")
    counts = [len(theirs[1]) for theirs in everyone]
    if len(set(counts)) > 1:
        return (f"the ranks passed different numbers of param groups ({_by_value(counts, ranks)}); "
                "pass the same param groups on every rank")
    for position, (index, _) in enumerate(everyone[0][1]):
        groups = [theirs[1][position][1] for theirs in everyone]
        for key in sorted(set().union(*groups)):
            values = [group.get(key, _UNSET) for group in groups]
            if any(v != values[0] for v in values):
                return (f"the ranks passed different {key!r} for param group {index} "
                        f"({_by_value(values, ranks)}); every parameter is stepped with its "
                        "owner's settings, so pass the same optimizer arguments and param "
                        "groups on every rank")
    return None


def agree_on_target(to: Any, process_group: dist.ProcessGroup | None, ranks: list[int]) -> None:
    """Raise on every rank if ``consolidate_state_dict(to=...)`` differs across ranks or is
    not a rank of the group (one small exchange; consolidation is rare)."""
    everyone: list[Any] = [None] * len(ranks)
    hang.run(group_progress(process_group), "ZeRO consolidate_state_dict target check",
             lambda: dist.all_gather_object(everyone, to, group=process_group))
    if any(t != everyone[0] for t in everyone):
        raise ValueError(
            f"consolidate_state_dict: the ranks passed different targets (to: "
            f"{_by_value(everyone, ranks)}); every rank must call it with the same to=, the "
            "rank that receives the state (to=0 on every rank, then state_dict() on rank 0)"
        )
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < len(ranks):
        raise ValueError(f"to={to!r} is not a rank of the process group (size {len(ranks)})")


def _comparable(value: Any) -> Any:
    """``value`` as a picklable object that compares by value (a tensor as its numbers, NaN
    equal to itself, an unknown object by its type)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()}, dtype={value.dtype})"
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return value
    return f"<{type(value).__qualname__}>"


def _by_value(values: list[Any], ranks: list[int]) -> str:
    """``0.1 on rank 0, 0.5 on ranks [1, 3]``: each value once, with the ranks that hold it."""
    holders: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks):
        holders.setdefault(repr(value) if not isinstance(value, str) else value, []).append(rank)
    return ", ".join(f"{value} on rank {found[0]}" if len(found) == 1 else f"{value} on ranks {found}"
                     for value, found in holders.items())
