"""Debug mode: before a collective, check that every rank calls the same one on the same tensors.

Ranks that disagree (one all-reduces a ``(4,)`` tensor, another a ``(5,)`` one, or another
broadcasts) hang or silently corrupt data. With ``LOCKSTEP_DEBUG_COLLECTIVES=1`` lockstep
compares what every rank is about to do and names the rank that differs and how. It costs a
round trip per collective, so it is off by default.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress

__all__ = [
    "DEBUG_ENV_VAR",
    "CollectiveMismatchError",
    "check_collective",
    "debug_collectives_enabled",
    "describe_mismatch",
    "odd_ranks",
    "signature",
]

DEBUG_ENV_VAR = "LOCKSTEP_DEBUG_COLLECTIVES"


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to call different collectives, or the same one on different tensors.

    Attributes:
        ranks: the global ranks whose call differs from the majority's.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


def debug_collectives_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``LOCKSTEP_DEBUG_COLLECTIVES`` asks for the checks (1, true, yes or on)."""
    value = (os.environ if environ is None else environ).get(DEBUG_ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def signature(name: str, tensors: Sequence[torch.Tensor]) -> str:
    """What must agree across ranks, e.g. ``all_reduce(float32[4, 3] cpu)``."""
    parts = [
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} {t.device.type}" for t in tensors
    ]
    return f"{name}({', '.join(parts)})"


def _majority(signatures: Sequence[str]) -> str:
    # The most common call is taken as intended; ties go to the lowest rank's call.
    counts = Counter(signatures)
    return max(counts, key=lambda sig: (counts[sig], -signatures.index(sig)))


def odd_ranks(signatures: Sequence[str], ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks whose signature differs from the most common one (as :func:`describe_mismatch`)."""
    ranks = list(range(len(signatures))) if ranks is None else list(ranks)
    majority = _majority(signatures)
    return [r for r, sig in zip(ranks, signatures) if sig != majority]


def describe_mismatch(signatures: Sequence[str], ranks: Sequence[int] | None = None) -> str | None:
    """Name the ranks whose signature differs from the most common one; ``None`` if all agree.

    Args:
        signatures: each rank's :func:`signature`, in group order.
        ranks: the global rank of each entry (by default ``0..n-1``).
    """
    ranks = list(range(len(signatures))) if ranks is None else list(ranks)
    if len(set(signatures)) == 1:
        return None
    majority = _majority(signatures)
    agreeing = [r for r, sig in zip(ranks, signatures) if sig == majority]
    odd = [f"rank {r} calls {sig}" for r, sig in zip(ranks, signatures) if sig != majority]
    return (
        f"ranks disagree on the next collective: {'; '.join(odd)}; while ranks {agreeing} call "
        f"{majority}. Every rank must issue the same collectives in the same order on tensors "
        "of the same shape and dtype (look for rank-dependent branches or uneven data)."
    )


def check_collective(name: str, tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Raise on every rank if the ranks of ``group`` are not all about to run this collective.

    Call it on every rank right before the collective (e.g. only when
    :func:`debug_collectives_enabled`). It is itself a collective (an all-gather of the
    signatures), so a rank that never calls it is caught by the group's timeout.

    Example::

        if debug_collectives_enabled():
            check_collective("all_reduce", [bucket], group)
        dist.all_reduce(bucket, group=group)

    Raises:
        CollectiveMismatchError: naming each rank that differs and what it called.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    progress = GroupProgress(group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    mine = signature(name, tensors)
    hang.run(progress, f"signature check before {name}",
             lambda: dist.all_gather_object(gathered, mine, group=group))
    message = describe_mismatch(gathered, progress.ranks)
    if message is not None:
        odd = odd_ranks(gathered, progress.ranks)
        hang.write_blame(dist.get_rank(), [{"rank": r, "state": "mismatch"} for r in odd], message)
        raise CollectiveMismatchError(message, odd)
