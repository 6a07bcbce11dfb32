"""Where gradients are reduced: per-parameter readiness, bucket launches, the end of backward.

Each trainable parameter has a post-accumulate-grad hook. When a parameter's gradient is final
for this backward pass, its hook marks it ready in its bucket; when a bucket's last parameter is
ready, that bucket — and any later ones already complete — is handed to the comm hook, which
starts an asynchronous all-reduce at once. Buckets launch strictly in index order so every rank
issues the same collectives in the same order. A callback queued on the autograd engine runs
when the outer backward ends (see ``backward_end.py``): it waits for what is still in flight,
and only that wait is "exposed" communication.

The bucket layout is fixed in the first synchronised backward, which only records the order in
which gradients arrive and reduces everything at its end, in buckets already built in that order
(rank 0's order, broadcast). Every later iteration — and the first iteration of a job resumed
from a checkpoint, which records the same order — reduces with that layout, so sums are rounded
identically and a resumed job stays bitwise equal to an uninterrupted one (issue 11). With
``find_unused_parameters`` the arrival order changes from one iteration to the next, so the
registration order is kept, as torch does. Under ``torch.compile`` the graph split proposes the
order instead (:meth:`Reducer.plan_buckets`, see ``compiled.py``), so buckets and pieces agree.

``static_graph=True`` means the graph is the same every iteration: the first backward also
counts how many times each gradient arrives (twice for a block checkpointed twice), and later
ones mark a parameter ready at its last arrival, with no search for unused parameters.

This module counts arrivals and finds the end of backward; the parts live beside it:
``bucket_layout.py`` (the layout, its recording and rebuild), ``bucket_launch.py`` (one
backward's buckets: filled, launched in order, waited, published) and ``unused.py`` (the
unused-parameter search and the static graph's record).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep._torch_compat import queue_callback
from lockstep.comm.hooks import GradBucket, allreduce_hook
from lockstep.ddp.backward_end import current_backward_id, hook_outputs
from lockstep.ddp.bucket import Bucket
from lockstep.ddp.bucket_launch import BucketRound, launch_zeros
from lockstep.ddp.bucket_layout import BucketLayout
from lockstep.ddp.observer import StepObserver
from lockstep.ddp.reducer_errors import (
    graph_changed,
    nested_with_find_unused,
    ready_twice,
    unused,
)
from lockstep.ddp.unused import ParameterUsage
from lockstep.diagnose import collective_checks
from lockstep.diagnose.progress import GroupProgress

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer:
    """Averages the gradients of ``params`` over ``group`` while backward runs.

    Args:
        params: trainable parameters, in registration order, without duplicates.
        names: their names, for error messages.
        group: the process group to reduce over.
        bucket_cap_bytes: the size of a bucket after the first (small) one.
        find_unused_parameters: tolerate parameters that get no gradient in an iteration.
        gradient_as_bucket_view: make each dense ``.grad`` a view of its bucket (no second copy).
        static_graph: the graph is the same every iteration (see module docstring).
        expect_sparse: per parameter, whether its gradient is sparse (own bucket, no view).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool = False,
        expect_sparse: Sequence[bool] | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.static_graph = static_graph
        # Searching for unused parameters every iteration: not with a static graph, whose
        # unused parameters are known after the first iteration.
        self.find_unused = find_unused_parameters and not static_graph
        self.as_view = gradient_as_bucket_view
        self.cap_bytes = bucket_cap_bytes
        self.comm_hook: Callable[[Any, GradBucket], torch.futures.Future] = allreduce_hook
        self.comm_state: Any = group
        self.clock: StepObserver | None = None
        # Set by join(): rescales the mean when it must be over the active ranks only.
        self.grad_scale = 1.0
        # LOCKSTEP_DEBUG_COLLECTIVES=1: before each bucket, check every rank reduces the same one.
        self._debug = collective_checks.debug_collectives_enabled()
        # Step, phase and collective counts for naming a peer that never arrives (memory only).
        self.progress = GroupProgress(group)
        n = len(self.params)
        sparse = list(expect_sparse) if expect_sparse is not None else [False] * n
        self._layout = BucketLayout(self.params, sparse, bucket_cap_bytes, fixed=self.find_unused,
                                    group=group, progress=self.progress)
        self._usage = ParameterUsage(self.params, group, self.progress)
        self._active = False
        self.started = False  # a forward has prepared a backward (static_graph is fixed from then)
        self._reset_iteration()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # ---- buckets -------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order (rebuilt once, at the end of the first backward)."""
        return self._layout.buckets

    @property
    def _where(self) -> list[tuple[int, int]]:
        # Parameter index -> (bucket, slot); tests/test_ddp.py checks the views through it.
        return self._layout.where

    def plan_buckets(self, order: Sequence[int]) -> list[list[int]]:
        """The buckets (parameter indices, launch order) for gradients finishing in ``order``.

        Before the layout is fixed, ``order`` is what the first synchronised backward builds its
        buckets in, instead of the order it records (torch.compile's graph split proposes it:
        see ``compiled.py``); orders proposed later (a second graph, later in forward) go first.
        Once fixed, the fixed buckets are returned.
        """
        return self._layout.plan(order)

    # ---- per-iteration state -------------------------------------------------------------
    def _reset_iteration(self) -> None:
        n = len(self.params)
        self._recording = not self._layout.fixed
        self._arrivals = [0] * n
        self._arrived_total = 0
        self._static_unused_filled = False
        self._arrival_order: list[int] = []
        self._callback_queued = False
        self._outer_backward = -1
        self._round = self._new_round()

    def _new_round(self) -> BucketRound:
        """Bucket bookkeeping for the current layout."""
        return BucketRound(self, self._layout, self._debug,
                           publish_all=not self.as_view or self._recording)

    def prepare_for_backward(self, sync: bool, outputs: Any = None) -> None:
        """Called at the end of each forward: whether the coming backward synchronises.

        Args:
            sync: reduce in the coming backward (False under ``no_sync()``).
            outputs: the forward's outputs; hooked so the end of the outer backward is found
                even when gradients arrive in nested backward passes.
        """
        if self._callback_queued or self._arrived_total:
            # A previous backward died half-way (an exception inside it): let its all-reduces
            # finish writing into the buckets before they are reused, then start clean.
            self._round.abandon()
            self._reset_iteration()
        self._active = sync
        self.started = True
        if not torch.compiler.is_compiling():  # bookkeeping stays out of a compiled graph
            self.progress.begin_step("after forward, before backward")
        # Under torch.compile the outputs are not hooked (the hook would be traced into the graph
        # and break it); the first gradient hook, which runs outside the graph, queues the end.
        if sync and outputs is not None and not torch.compiler.is_compiling():
            hook_outputs(outputs, self._on_output_grad)

    def _on_output_grad(self) -> None:
        if self._active and not self._callback_queued:
            self._queue_finalize()

    def _queue_finalize(self) -> None:
        queue_callback(self._finalize)
        self._callback_queued = True
        self._outer_backward = current_backward_id()
        self.progress.set_phase("backward")
        if self.clock is not None:
            self.clock.backward_started()

    # ---- gradient hooks ------------------------------------------------------------------
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        # The parameter holds its hook from C++, where the garbage collector cannot see it: a
        # hook holding the reducer (which holds the parameters) kept both alive after the model
        # was dropped, and with them its process group and rank 0's store (until 2026-11-29 a
        # process could not join a new group on the same address). The hook holds it weakly.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            reducer = ref()
            if reducer is None:
                return
            if reducer._active:
                reducer._on_grad(i, param)
            elif reducer.find_unused and param.grad is not None:
                reducer._usage.mark_used(i)  # a no_sync() backward: this gradient is reduced too

        return hook

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._queue_finalize()  # outputs not hooked (no tensor output): best effort
        if self.find_unused:
            if current_backward_id() != self._outer_backward:
                # torch's DDP finds this parameter unreachable from the outputs, takes it for
                # unused, and fails when its gradient arrives: fail the same way, clearly.
                raise nested_with_find_unused(self.names[i])
            if param.grad is not None:
                self._usage.mark_used(i)
        self._arrivals[i] += 1
        self._arrived_total += 1
        arrived, expected = self._arrivals[i], self._usage.expected[i]
        if self._recording:
            if arrived > 1 and not self.static_graph:
                raise ready_twice(self.names[i], dist.get_rank())
            self._arrival_order.append(i)
            return
        if arrived < expected:
            return  # static graph: more of this gradient is still to come
        if arrived > expected:
            if self.static_graph:
                raise graph_changed(self.names[i], arrived, expected)
            raise ready_twice(self.names[i], dist.get_rank())
        static_unused = self._usage.static_unused
        if static_unused and not self._static_unused_filled:
            self._static_unused_filled = True
            self._round.fill(static_unused)  # torch marks them ready at the first hook
        self._round.ready(i, param)

    # ---- end of backward -----------------------------------------------------------------
    def _finalize(self) -> None:
        if self.clock is not None:
            self.clock.backward_compute_ended()
        if not self._arrived_total:
            # The outputs' gradients were computed but no parameter's (autograd.grad with
            # respect to the inputs): nothing to reduce yet; the next backward will.
            self._callback_queued = False
            return
        try:
            self._reduce_and_publish()
        finally:
            self._active = False
            self._reset_iteration()  # after a rebuild: sized for the new buckets
            self.progress.set_phase("after backward (optimizer step, data loading, next forward)")
        if self.clock is not None:
            self.clock.backward_ended()

    def _reduce_and_publish(self) -> None:
        recording, usage = self._recording, self._usage
        if recording:
            last_seen = {i: pos for pos, i in enumerate(self._arrival_order)}
            arrival = sorted(last_seen, key=last_seen.__getitem__)
            self._layout.fix(arrival)
            self._round = self._new_round()  # for the new layout; arrivals kept
            for i in arrival:
                self._round.mark_ready(i, self.params[i])
        unready = self._round.unready()
        self._round.fill(unready)  # also launches what is left (everything, when recording)
        self._round.wait_all()
        if recording and self.static_graph:
            usage.record_static_graph(self._arrivals, unready)
            unready = []
        if unready and self.static_graph:
            missing = usage.missing(unready)
            if missing:
                i = missing[0]
                raise graph_changed(self.names[i], self._arrivals[i], usage.expected[i])
        if unready and not self.find_unused and not self.static_graph:
            raise unused([self.names[i] for i in unready], dist.get_rank())
        if self.find_unused:  # every rank takes part, whatever it saw locally
            globally_unused = usage.take_globally_unused()
        else:
            globally_unused = usage.static_global_unused
        self._round.publish(globally_unused)

    # ---- join --------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """Issue this iteration's collectives with zero gradients (a rank that has joined).

        Zeros go through the same comm hook, in the same bucket order, so stateful hooks and the
        peers' all-reduces see exactly the sequence they expect.
        """
        recording = not self._layout.fixed
        if recording:
            self._layout.fix([])  # the proposed order, if any
        launch_zeros(self._layout.buckets, self)
        if self.find_unused or (recording and self.static_graph):
            self._usage.globally_unused(list(range(len(self.params))))
        self._reset_iteration()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
