"""Which worlds can run ``V`` virtual shards, and the ``V`` the launcher gives its workers.

Torch-free, so ``lockstep run --virtual-shards V`` checks its worlds without importing the
training machinery (:mod:`lockstep.ddp.virtual_shards`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "VIRTUAL_SHARDS_ENV",
    "check_virtual_shards",
    "is_power_of_two",
    "resolve_virtual_shards",
    "virtual_shards_env",
]

VIRTUAL_SHARDS_ENV = "LOCKSTEP_VIRTUAL_SHARDS"  # set by ``lockstep run --virtual-shards V``


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def check_virtual_shards(virtual_shards: int, world_size: int) -> int:
    """The number of shards each rank runs; ``ValueError`` if ``world_size`` cannot run them.

    Raises:
        ValueError: ``virtual_shards`` is not a power of two, or ``world_size`` does not
            divide it.
    """
    if not isinstance(virtual_shards, int) or isinstance(virtual_shards, bool):
        raise TypeError(f"virtual_shards must be an int, got {type(virtual_shards).__name__}")
    if not is_power_of_two(virtual_shards):
        raise ValueError(
            f"virtual_shards={virtual_shards} is not a power of two: the fixed summation tree "
            f"needs one (e.g. virtual_shards=8 runs bitwise-identically on 1, 2, 4 or 8 ranks)"
        )
    if virtual_shards % world_size != 0:
        raise ValueError(
            f"a world of {world_size} ranks does not divide virtual_shards={virtual_shards}: "
            f"run on a power of two of ranks up to {virtual_shards}, or change virtual_shards "
            f"(which starts another run)"
        )
    return virtual_shards // world_size


def resolve_virtual_shards(value: int | None, environ: Mapping[str, str] | None = None) -> int:
    """``value``, or the ``V`` that ``lockstep run --virtual-shards V`` gave the workers."""
    if value is not None:
        return value
    text = (os.environ if environ is None else environ).get(VIRTUAL_SHARDS_ENV)
    if text is None:
        raise ValueError(
            f"virtual_shards was not given and {VIRTUAL_SHARDS_ENV} is not set: pass "
            f"virtual_shards=V or launch with lockstep run --virtual-shards V"
        )
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{VIRTUAL_SHARDS_ENV}={text!r} is not an int") from None


def virtual_shards_env(
    virtual_shards: int, nproc_per_node: int, min_nodes: int, max_nodes: int
) -> dict[str, str]:
    """The workers' environment for ``--virtual-shards``; ``ValueError`` if a world cannot run it.

    Every world the job may have (``nproc_per_node`` times ``min_nodes..max_nodes``) must divide
    ``virtual_shards``, so a job that shrinks or grows stays the same run.
    """
    for nodes in range(min_nodes, max_nodes + 1):
        try:
            check_virtual_shards(virtual_shards, nproc_per_node * nodes)
        except ValueError as err:
            raise ValueError(f"--virtual-shards {virtual_shards}: {err}") from None
    return {VIRTUAL_SHARDS_ENV: str(virtual_shards)}
