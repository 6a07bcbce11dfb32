"""The reducer's errors: each names the parameter and rank, says why, and what to do.

They are raised where torch's DDP raises for the same program (its "Expected to mark a variable
ready only once"), so a script that fails under one fails under the other, never trains on a
wrong gradient.
"""

from __future__ import annotations

__all__ = ["graph_changed", "nested_with_find_unused", "ready_twice", "unused"]

_TORCH_TOO = "(torch's DDP raises here too: \"Expected to mark a variable ready only once\")"


def ready_twice(name: str, rank: int) -> RuntimeError:
    return RuntimeError(
        f"DistributedDataParallel: parameter {name!r} received its gradient twice in one backward "
        f"pass on rank {rank} {_TORCH_TOO}. Usual causes: a block under reentrant activation "
        "checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) run twice in one "
        "forward, a parameter used both inside and outside such a block, or two backward calls "
        "through one forward. Use use_reentrant=False, or static_graph=True if the model runs "
        "the same graph every iteration."
    )


def nested_with_find_unused(name: str) -> RuntimeError:
    return RuntimeError(
        f"DistributedDataParallel: parameter {name!r} received its gradient in a nested backward "
        "pass (reentrant activation checkpointing, use_reentrant=True) while "
        "find_unused_parameters=True; such a parameter cannot be told apart from an unused one "
        f"{_TORCH_TOO}. Use use_reentrant=False, or static_graph=True instead of "
        "find_unused_parameters=True if the same parameters are used every iteration."
    )


def graph_changed(name: str, arrived: int, expected: int) -> RuntimeError:
    return RuntimeError(
        f"DistributedDataParallel(static_graph=True): parameter {name!r} received its gradient "
        f"{arrived} time(s) in this backward pass but {expected} time(s) in the first one; the "
        "graph changed between iterations, which static_graph=True does not allow. Pass "
        "find_unused_parameters=True instead of static_graph=True."
    )


def unused(names: list[str], rank: int) -> RuntimeError:
    shown = f"{names[:10]}{' ...' if len(names) > 10 else ''}"
    return RuntimeError(
        f"DistributedDataParallel: rank {rank} computed no gradient for {len(names)} "
        f"parameter(s) in this backward pass: {shown}. Make every parameter take part in the "
        "loss, freeze the ones you don't train (requires_grad=False) before wrapping, or pass "
        "find_unused_parameters=True."
    )
