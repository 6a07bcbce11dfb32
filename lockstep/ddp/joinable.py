"""Uneven inputs and torch's ``Joinable``: the wrapper's side of ``join``.

:class:`JoinableDDP` is a base of :class:`~lockstep.ddp.DistributedDataParallel`: lockstep's own
``model.join()`` context, the members torch's generic ``Join([model, optimizer])`` calls
(``join_hook``, ``join_device``, ``join_process_group``), and the small seam the join machinery
(``join.py``) and pipelines drive the reducer through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from lockstep.ddp.join import DDPJoinHook, JoinableModel, UnevenInputs

if TYPE_CHECKING:
    from lockstep.ddp.delayed import DelayedAllReduce
    from lockstep.ddp.observer import StepObserver
    from lockstep.ddp.reducer import Reducer

__all__ = ["JoinableDDP"]


class _Reusable:
    """What ``join()`` returns: a context manager that can be entered again (one made once and
    used every epoch), as torch's ``Join`` can; each ``with`` runs a fresh join."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._make = make
        self._active: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        context = self._make()
        context.__enter__()
        self._active.append(context)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        return self._active.pop().__exit__(kind, value, tb)


class JoinableDDP(Joinable):
    """The join members of lockstep's DDP (see the module docstring); not used on its own."""

    # Set by DistributedDataParallel.
    device: torch.device
    process_group: dist.ProcessGroup
    _reducer: Reducer | None
    _delayed: DelayedAllReduce | None
    _uneven: UnevenInputs | None
    _torch_join: UnevenInputs | None
    _clock: StepObserver | None

    @property
    def join_device(self) -> torch.device:
        """torch's ``Joinable``: where join's own collectives run."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """torch's ``Joinable``: the group join's collectives run over."""
        return self.process_group

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """torch's ``Joinable``: the hook ``torch.distributed.algorithms.Join([model, ...])`` runs.

        Args:
            divide_by_initial_world_size: average over all ranks (True, default) or over the
                ranks still active in each iteration.
        """
        state = UnevenInputs(cast(JoinableModel, self),
                             kwargs.get("divide_by_initial_world_size", True), False)
        self._torch_join = state

        def done() -> None:
            self._torch_join = None

        return DDPJoinHook(state, done)

    def set_gradient_scale(self, scale: float) -> None:
        """Multiply the averaged gradients of every later backward by ``scale`` (join uses it)."""
        if self._reducer is not None:
            self._reducer.grad_scale = scale

    def shadow_backward(self) -> None:
        """Issue one backward's gradient collectives with zeros (a rank that has joined)."""
        if self._reducer is not None:
            self._reducer.shadow_backward()

    def sync_next_backward(self) -> None:
        """Make the coming backward average gradients, whatever the last forward decided.

        For schedules whose backward order differs from their forward order (pipelines run
        every forward under ``no_sync`` and arm only the last backward).
        """
        if self._reducer is not None:
            self._reducer.prepare_for_backward(True)
        if self._delayed is not None:
            self._delayed.armed = True

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> _Reusable:
        """Train on uneven inputs: a rank that runs out of batches shadows the others.

        Wrap the whole training loop. At the end every rank holds the model of the rank that ran
        the most iterations. Costs one tiny all-reduce per forward while enabled. (torch's
        ``Join([model, optimizer])`` works too, through :meth:`join_hook`.)

        Args:
            divide_by_initial_world_size: average over all ranks (True), or over the ranks that
                still have inputs in each iteration (False).
            enable: turn the context off without changing code.
            throw_on_early_termination: instead, raise on every rank as soon as one runs out.

        Example::

            with model.join():
                for x, y in loader:          # loaders of different lengths per rank
                    ...
        """
        return _Reusable(lambda: self._join(divide_by_initial_world_size, enable,
                                            throw_on_early_termination))

    @contextlib.contextmanager
    def _join(self, divide_by_initial_world_size: bool, enable: bool,
              throw_on_early_termination: bool) -> Iterator[None]:
        if not enable or self._reducer is None:
            yield
            return
        state = UnevenInputs(cast(JoinableModel, self), divide_by_initial_world_size, throw_on_early_termination)
        self._uneven = state
        if self._clock is not None:
            self._clock.gathers_paused = True  # a joined rank would miss the gather
        try:
            yield
            self._uneven = None  # this rank's own forwards are over: now it only shadows
            state.shadow_until_all_joined()
        finally:
            self._uneven = None
            self.set_gradient_scale(1.0)
            if self._clock is not None:
                self._clock.gathers_paused = False
