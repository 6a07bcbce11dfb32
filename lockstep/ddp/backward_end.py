"""Finding the true end of a backward pass, nested backward passes included.

The reducer finishes an iteration in a callback queued on the autograd engine, which runs when
the *graph task* it was queued on ends. Reentrant activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``) runs a nested backward — a graph task of
its own — inside the outer one: a callback queued from a gradient hook that happens to fire in
that nested task runs when the nested task ends, before the outer backward has produced the
other gradients. So the reducer hooks the forward's outputs: their gradients are computed first,
in the outer task, and the callback queued from there runs at the real end (torch's DDP queues
its first-iteration callback from the outputs in the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lockstep._torch_compat import current_graph_task_id
from lockstep.tensors import iter_tensors

__all__ = ["current_backward_id", "hook_backward_start", "hook_outputs"]


def hook_outputs(output: Any, on_grad: Callable[[], None]) -> int:
    """Call ``on_grad()`` whenever the gradient of a tensor in ``output`` is computed.

    Walks tuples, lists and dicts (model outputs such as ``ModelOutput`` are dicts).

    Returns:
        How many tensors were hooked (0: none requires grad).
    """

    def hook(grad: torch.Tensor) -> None:
        on_grad()

    hooked = 0
    for tensor in iter_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)
            hooked += 1
    return hooked


def current_backward_id() -> int:
    """An id of the graph task (backward pass) running on this thread; -1 outside backward."""
    return current_graph_task_id()


def hook_backward_start(output: Any, on_start: Callable[[], None]) -> int:
    """Call ``on_start()`` once per backward pass through ``output``: when the first gradient
    of any of its tensors is computed (a loss on any one output, not necessarily the first:
    a model that returns an auxiliary tensor first and the logits second).

    Returns:
        How many tensors were hooked (0: none requires grad).
    """
    seen: list[int] = []  # the backward passes already marked (one, unless retain_graph)

    def once() -> None:
        task = current_graph_task_id()
        if task not in seen:
            seen.append(task)
            on_start()

    return hook_outputs(output, once)
