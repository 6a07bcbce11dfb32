"""Profiling of lockstep's DistributedDataParallel: the wrapper's side of ``lockstep doctor``.

:class:`ProfiledDDP` is a base of :class:`~lockstep.ddp.DistributedDataParallel`: it starts a
recorder (the doctor's :class:`~lockstep.doctor.recorder.Recorder`, built through
:mod:`lockstep.profilers`, so DDP never imports the doctor), marks forward and the start of
backward on it (the reducer marks buckets and the end of backward), and at a world of one, where
there is no reducer, watches gradient arrivals (:mod:`lockstep.ddp.arrivals`) so the profile
still lists the buckets DDP would send. The recorder is told everything through
:class:`~lockstep.ddp.observer.StepObserver`.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep import profilers
from lockstep._torch_compat import queue_callback
from lockstep.ddp.arrivals import GradientArrivals
from lockstep.ddp.backward_end import hook_backward_start
from lockstep.ddp.observer import StepObserver
from lockstep.ddp.replica_sync import broadcast_messages, live_buffers
from lockstep.profilers import StepTiming

if TYPE_CHECKING:
    from lockstep.ddp.reducer import Reducer

__all__ = ["ProfiledDDP"]


class ProfiledDDP(nn.Module):
    """The profiling methods of DistributedDataParallel (see :meth:`enable_profiling`)."""

    # Set by DistributedDataParallel.
    module: nn.Module
    device: torch.device
    process_group: Any  # dist.ProcessGroup (typed where DistributedDataParallel sets it)
    world_size: int
    require_backward_grad_sync: bool
    forward_sync_buffers: bool
    _buffer_slots: list[tuple[nn.Module, str]]
    _reducer: Reducer | None
    _trainable_names: list[str]
    _bucket_cap_bytes: int
    _clock: StepObserver | None  # the Recorder enable_profiling started
    _profile_hooks: list[Any]
    _arrivals: GradientArrivals | None

    def enable_profiling(
        self,
        enabled: bool = True,
        *,
        out_dir: str | os.PathLike | None = None,
        max_steps: int | None = None,
        warmup: int = 5,
        gather_every: int = 0,
    ) -> StepObserver | None:
        """Record every step: data wait, forward, backward, each bucket, exposed wait, optimizer.

        Cheap enough to leave on (no device synchronisation, no collective unless
        ``gather_every``). ``lockstep doctor`` turns it on through ``LOCKSTEP_PROFILE``.

        Args:
            enabled: False stops profiling (and saves, if ``out_dir`` was given).
            out_dir: each rank writes ``rank<R>.json`` there when the process exits.
            max_steps: end the process after this many steps (bounded runs).
            warmup: first steps left out of summaries.
            gather_every: every this many steps, rank 0 logs which rank is slowest and where
                (one small asynchronous all-gather; 0: never).

        Returns:
            The recorder (the doctor's :class:`~lockstep.doctor.recorder.Recorder`), or None
            when disabled.

        Example::

            model.enable_profiling()
            ...train...
            report = lockstep.doctor.gather_report(model.profiler)   # on every rank
        """
        if self._clock is not None:
            self._clock.close()
            for handle in self._profile_hooks:
                handle.remove()
        if self._arrivals is not None:
            self._arrivals.remove()
        self._clock, self._profile_hooks, self._arrivals = None, [], None
        if enabled:
            params = [p for p in self.module.parameters() if p.requires_grad]
            group = self.process_group if self.world_size > 1 else None
            clock: StepObserver = profilers.current().ddp(
                self.device, params, group, self._bucket_layout, self._profile_model_entry(),
                out_dir, max_steps, warmup, gather_every,
            )
            self._clock = clock
            self._profile_hooks = [self.register_forward_pre_hook(self._profile_forward_pre),
                                   self.register_forward_hook(self._profile_forward_post)]
            if self._reducer is None and self._trainable_names:
                # A world of one: the profile still gives the buckets DDP would send, with the
                # moment each would be ready (what `lockstep plan` predicts larger worlds from).
                named = dict(self.module.named_parameters())
                self._arrivals = GradientArrivals(
                    [named[n] for n in self._trainable_names], self._trainable_names,
                    self._bucket_cap_bytes, clock)
        if self._reducer is not None:
            self._reducer.clock = self._clock
        return self.profiler

    def _profile_model_entry(self) -> dict[str, Any]:
        return _model_entry(self.module, live_buffers(self._buffer_slots), self.forward_sync_buffers)

    @property
    def profiler(self) -> StepObserver | None:
        """The recorder :meth:`enable_profiling` started, or None."""
        return self._clock

    def enable_step_timing(self, enabled: bool = True) -> None:
        """Record forward, backward and exposed-communication seconds (see :meth:`enable_profiling`)."""
        self.enable_profiling(enabled)

    @property
    def step_timings(self) -> list[StepTiming]:
        """One :class:`~lockstep.profilers.StepTiming` per backward since timing was enabled."""
        clock = self.profiler
        return clock.step_timings if clock is not None else []

    def _bucket_layout(self) -> list[dict[str, Any]]:
        reducer = self._reducer
        if reducer is None:
            return self._arrivals.layout() if self._arrivals is not None else []
        return [{"index": b.index, "bytes": b.nbytes,
                 "params": [reducer.names[i] for i in b.param_indices]} for b in reducer.buckets]

    # Profiling marks never enter a compiled graph (a clock read would break it). Under
    # torch.compile(ddp) these hooks run outside the graph, as Python (Dynamo would otherwise
    # trace them away); inside a larger compiled function the forward goes unmarked and backward
    # is marked by the reducer's hooks.
    @torch.compiler.disable()
    def _profile_forward_pre(self, module: nn.Module, inputs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._clock is not None and torch.is_grad_enabled():
            self._clock.forward_started(inputs)

    @torch.compiler.disable()
    def _profile_forward_post(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        clock = self._clock
        if clock is not None and torch.is_grad_enabled():
            clock.forward_ended()
            ends_itself = self._reducer is None or not self.require_backward_grad_sync
            _hook_first_tensor(output, clock, end_on_backward=ends_itself,
                               synced=self._reducer is None)


def _model_entry(module: nn.Module, buffers: list[torch.Tensor],
                broadcast_each_forward: bool) -> dict[str, Any]:
    """The ``model`` entry of the profile format (docs/profile-format.md).

    ``buffer_broadcasts`` lists the bytes of each message DDP broadcasts from rank 0 before
    every forward (none when ``broadcast_buffers=False``); ``lockstep plan`` prices them.
    """
    every = list(module.parameters())
    trained = [p for p in every if p.requires_grad]
    return {
        "parameters": sum(p.numel() for p in every),
        "trainable_parameters": sum(p.numel() for p in trained),
        "param_bytes": sum(p.numel() * p.element_size() for p in every),
        "grad_bytes": sum(p.numel() * p.element_size() for p in trained),
        "dtype": str(trained[0].dtype).replace("torch.", "") if trained else None,
        "buffers": len(buffers),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "buffer_broadcasts": broadcast_messages(buffers) if broadcast_each_forward else [],
    }


def _hook_first_tensor(output: Any, clock: StepObserver, end_on_backward: bool, synced: bool) -> None:
    """Mark the start of backward when the first gradient of an output tensor is computed.

    Without a reducer (a world of one) nothing else marks the end of backward, so the hook
    also queues that on the autograd engine.
    """

    def started() -> None:
        clock.backward_started()
        if end_on_backward:
            queue_callback(
                functools.partial(clock.backward_ended, synced=synced))

    hook_backward_start(output, started)
