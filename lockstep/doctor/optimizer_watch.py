"""Which optimizer steps belong to a model: torch's global step hooks, filtered by parameters.

torch offers optimizer step hooks only globally (every optimizer of the process calls them), so
a profiler that wants "this model's optimizer step" without user code installs one pre and one
post hook and keeps those optimizers that hold at least one of the model's parameters (decided
once per optimizer, remembered weakly). An optimizer stepped inside another's step (torch's
``ZeroRedundancyOptimizer`` steps its inner optimizer, then syncs the parameters) is part of the
outer step: only the outermost step starts and ends. The hooks hold the watch weakly: a profiler
dropped without :meth:`OptimizerWatch.close` leaves two empty hooks behind, not itself.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["OptimizerWatch"]


class OptimizerWatch:
    """Calls ``started()`` before and ``ended()`` after each step of an optimizer of ``params``.

    Args:
        params: the model's parameters; an optimizer holding any of them is the model's.
        started: called before such an optimizer's ``step()``.
        ended: called after it.
    """

    def __init__(self, params: Iterable[torch.Tensor], started: Callable[[], None],
                 ended: Callable[[], None]) -> None:
        self._param_ids = {id(p) for p in params}
        self._ours: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._started, self._ended = started, ended
        self._depth = 0  # steps of the model's optimizers under way (nested: ZeRO's inner one)
        self._handles = [register_optimizer_step_pre_hook(_weak_hook(self._pre)),
                         register_optimizer_step_post_hook(_weak_hook(self._post))]

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds one of the watched parameters."""
        known = self._ours.get(optimizer)
        if known is None:
            known = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            self._ours[optimizer] = known
        return known

    def present(self) -> bool:
        """Whether an optimizer holding a watched parameter exists now (stepped or not).

        One pass over the objects the garbage collector tracks (torch keeps no registry of
        optimizers): call it rarely. A recorder asks once, before the model's first optimizer
        step, to tell gradient accumulation (backwards before a step) from a script with no
        torch optimizer (a step per backward).
        """
        return any(isinstance(obj, torch.optim.Optimizer) and self.owns(obj)
                   for obj in gc.get_objects())

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.owns(optimizer):
            self._depth += 1
            if self._depth == 1:
                self._started()

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.owns(optimizer) and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self._ended()

    def close(self) -> None:
        """Remove both hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _weak_hook(method: Callable[..., None]) -> Callable[..., None]:
    """A hook that calls ``method`` while its object is alive, and does nothing after."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        alive = ref()
        if alive is not None:
            alive(*args)

    return hook
