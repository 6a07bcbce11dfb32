"""The per-unit options of ``fully_shard`` that every rank must give alike.

``reshard_after_forward`` decides whether a unit gathers again in backward, and the
mixed-precision policy the dtype (so the size) of its gathers and reductions: ranks that
disagree run different collectives, or the same ones with other sizes, and hang or abort with
a message that blames a rank that did nothing wrong. The root's start-up check exchanges these
with the parameters' names and shapes, once, and compares them here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OPTIONS", "UnitSettings", "settings_mismatch"]

# The options compared, in this order, for each unit.
OPTIONS = ("reshard_after_forward", "param_dtype", "reduce_dtype", "output_dtype",
           "cast_forward_inputs")

# (unit name, (value of each of OPTIONS, as a plain picklable object)...)
UnitSettings = list[tuple[str, tuple[Any, ...]]]


def settings_mismatch(everyone: list[UnitSettings], ranks: list[int]) -> str | None:
    """The first unit option the ranks disagree on, with each rank's value; ``None`` if none."""
    names = [[name for name, _ in theirs] for theirs in everyone]
    if any(n != names[0] for n in names):
        return ("the ranks sharded different modules (units: "
                f"{_by_value([str(n) for n in names], ranks)}); call fully_shard on the same "
                "modules on every rank")
    for position, name in enumerate(names[0]):
        for k, option in enumerate(OPTIONS):
            values = [theirs[position][1][k] for theirs in everyone]
            if any(v != values[0] for v in values):
                return (f"the ranks passed different {option} for the unit '{name}' "
                        f"({_by_value(values, ranks)}); pass the same fully_shard options "
                        "(reshard_after_forward, mp_policy) for each module on every rank")
    return None


def _by_value(values: list[Any], ranks: list[int]) -> str:
    """``True on rank 0, False on ranks [1, 3]``: each value once, with the ranks holding it."""
    holders: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks):
        holders.setdefault(str(value), []).append(rank)
    return ", ".join(f"{value} on rank {found[0]}" if len(found) == 1 else f"{value} on ranks {found}"
                     for value, found in holders.items())
