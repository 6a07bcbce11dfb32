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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from lockstep import collective_checks, hang
from lockstep.ddp.backward_end import current_backward_id, hook_outputs
from lockstep.ddp.bucket import Bucket, BucketSpec, assign_buckets, complete_order
from lockstep.ddp.comm_hooks import GradBucket, allreduce_hook
from lockstep.ddp.reducer_errors import (
    graph_changed,
    nested_with_find_unused,
    ready_twice,
    unused,
)
from lockstep.ddp.sparse import SparseGradBucket, empty_sparse_grad, sparse_grad_of
from lockstep.doctor.recorder import Recorder
from lockstep.progress import GroupProgress

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
        self.clock: Recorder | None = None
        # Set by join(): rescales the mean when it must be over the active ranks only.
        self.grad_scale = 1.0
        # LOCKSTEP_DEBUG_COLLECTIVES=1: before each bucket, check every rank reduces the same one.
        self._debug = collective_checks.debug_collectives_enabled()
        # Step, phase and collective counts for naming a peer that never arrives (memory only).
        self.progress = GroupProgress(group)
        n = len(self.params)
        sparse = list(expect_sparse) if expect_sparse is not None else [False] * n
        self._specs = [BucketSpec.of(p, s) for p, s in zip(self.params, sparse)]
        self._layout_fixed = self.find_unused
        self._proposed: list[int] = []  # a layout order proposed before it is fixed (compile)
        # Gradient arrivals per parameter in one backward (static graph: counted in the first).
        self._expected = [1] * n
        self._static_unused: list[int] = []  # static graph: never reached on this rank
        self._static_global_unused: set[int] = set()  # static graph: reached on no rank
        # find_unused: parameters given a gradient since the last synchronised backward,
        # no_sync() backwards included (their accumulated gradient is reduced too).
        self._used = [False] * n
        self.buckets: list[Bucket] = []
        self._build(list(reversed(range(n))))
        self._active = False
        self._reset_iteration()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # ---- buckets -------------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """(Re)allocate bucket buffers for ``order``."""
        assignment = assign_buckets(self._specs, order, self.cap_bytes)
        if self.buckets and assignment == [b.param_indices for b in self.buckets]:
            return
        self.buckets = [
            Bucket.allocate(b, idx, self.params, sparse=self._specs[idx[0]].sparse)
            for b, idx in enumerate(assignment)
        ]
        self._where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket.index, slot)

    def _rebuild(self, arrival: list[int]) -> None:
        """Rebuild buckets in rank 0's arrival order (broadcast: every rank builds the same)."""
        order = torch.tensor(complete_order(arrival, len(self.params)), dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            order = order.to(self.params[0].device)
        src = dist.get_global_rank(self.group, 0)
        hang.run(self.progress, "DDP bucket-order broadcast",
                 lambda: dist.broadcast(order, src=src, group=self.group))
        self._build(order.cpu().tolist())
        self._layout_fixed = True

    def plan_buckets(self, order: Sequence[int]) -> list[list[int]]:
        """The buckets (parameter indices, launch order) for gradients finishing in ``order``.

        Before the layout is fixed, ``order`` is what the first synchronised backward builds its
        buckets in, instead of the order it records (torch.compile's graph split proposes it:
        see ``compiled.py``); orders proposed later (a second graph, later in forward) go first.
        Once fixed, the fixed buckets are returned.
        """
        if self._layout_fixed:
            return [list(b.param_indices) for b in self.buckets]
        known = set(self._proposed)
        self._proposed = [i for i in order if i not in known] + self._proposed
        return assign_buckets(self._specs, complete_order(self._proposed, len(self.params)),
                              self.cap_bytes)

    # ---- per-iteration state -------------------------------------------------------------
    def _reset_iteration(self) -> None:
        n = len(self.params)
        self._recording = not self._layout_fixed
        self._pending = [len(b.param_indices) for b in self.buckets]
        self._arrivals = [0] * n
        self._arrived_total = 0
        self._static_unused_filled = False
        self._arrival_order: list[int] = []
        self._ready = [False] * n
        self._saved: dict[int, torch.Tensor | None] = {}
        self._sparse_grads: dict[int, torch.Tensor] = {}
        self._futures: list[torch.futures.Future | None] = [None] * len(self.buckets)
        self._seqs = [0] * len(self.buckets)
        self._next_launch = 0
        self._callback_queued = False
        self._outer_backward = -1
        self._publish_all = not self.as_view or self._recording

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
            for fut in self._futures:
                if fut is not None:
                    try:
                        fut.wait()
                    except Exception:
                        logger.debug("all-reduce of an abandoned backward failed", exc_info=True)
            self._reset_iteration()
        self._active = sync
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
        Variable._execution_engine.queue_callback(self._finalize)
        self._callback_queued = True
        self._outer_backward = current_backward_id()
        self.progress.set_phase("backward")
        if self.clock is not None:
            self.clock.backward_started()

    # ---- gradient hooks ------------------------------------------------------------------
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._active:
                self._on_grad(i, param)
            elif self.find_unused and param.grad is not None:
                self._used[i] = True  # a no_sync() backward: this gradient will be reduced too

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
                self._used[i] = True
        self._arrivals[i] += 1
        self._arrived_total += 1
        arrived, expected = self._arrivals[i], self._expected[i]
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
        if self._static_unused and not self._static_unused_filled:
            self._static_unused_filled = True
            self._fill(self._static_unused)  # torch marks them ready at the first hook
        self._mark_ready(i, param)
        b = self._where[i][0]
        if self._pending[b] == 0:
            if self.clock is not None:
                self.clock.bucket_ready(b, self.names[i])
            self._launch_ready()

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        """Put ``param``'s gradient in its bucket slot (no launch)."""
        b, slot = self._where[i]
        bucket = self.buckets[b]
        self._ready[i] = True
        self._pending[b] -= 1
        if bucket.sparse:
            self._sparse_grads[b] = sparse_grad_of(param, self.names[i])
            return
        view = bucket.views[slot]
        grad = param.grad
        if grad is None:
            # The hook ran with an undefined gradient (e.g. a Function returned None for it):
            # it contributes zeros, and gets the mean at the end.
            view.zero_()
            self._publish_all = True
        elif grad is not view:
            if grad.is_sparse:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {self.names[i]!r} received a sparse "
                    "gradient, but only nn.Embedding/nn.EmbeddingBag(sparse=True) weights are "
                    "expected to have one. Use a dense gradient, or a sparse embedding module."
                )
            # .grad was reset to None (zero_grad) and autograd made a fresh tensor: copy it in
            # once and, in view mode, point .grad back at the bucket.
            view.copy_(grad)
            if self.as_view:
                param.grad = view

    def _fill(self, indices: list[int]) -> None:
        """Mark parameters without a gradient this pass ready; remember their ``.grad``."""
        for i in indices:
            param, (b, slot) = self.params[i], self._where[i]
            grad = param.grad
            if self.buckets[b].sparse:
                self._saved[i] = grad  # a comm hook divides its input in place: give it a copy
                self._sparse_grads[b] = empty_sparse_grad(param) if grad is None else grad.clone()
                self._ready[i] = True
                self._pending[b] -= 1
                continue
            view = self.buckets[b].views[slot]
            # Globally unused parameters keep their .grad: a copy if the all-reduce will
            # overwrite it (it is the bucket view), else the untouched tensor itself.
            self._saved[i] = grad.detach().clone() if grad is view else grad
            if grad is None:
                view.zero_()
            elif grad is not view:
                view.copy_(grad)
            self._ready[i] = True
            self._pending[b] -= 1
        self._publish_all = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        last = len(self.buckets) - 1
        while self._next_launch <= last and self._pending[self._next_launch] == 0:
            bucket = self.buckets[self._next_launch]
            grad_bucket: GradBucket
            if bucket.sparse:
                grad = self._sparse_grads[bucket.index]
                grad_bucket = SparseGradBucket(bucket.index, grad, bucket.params[0], bucket.index == last)
            else:
                grad_bucket = GradBucket(
                    bucket.index, bucket.buffer, bucket.params, bucket.offsets, bucket.index == last
                )
            if self._debug:
                tensors = [] if bucket.sparse else [bucket.buffer]
                collective_checks.check_collective(
                    f"all_reduce(bucket {bucket.index})", tensors, self.group
                )
            if self.clock is not None:
                self.clock.bucket_launched(bucket.index)
            op = f"DDP gradient all-reduce (bucket {bucket.index})"
            seq = self._seqs[bucket.index] = self.progress.enter(op)
            self._futures[bucket.index] = fut = hang.call_as(
                self.progress, seq, op, partial(self.comm_hook, self.comm_state, grad_bucket))
            if self.clock is not None:
                self.clock.watch_bucket(bucket.index, fut)
            self._next_launch += 1

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
        recording = self._recording
        if recording:
            last_seen = {i: pos for pos, i in enumerate(self._arrival_order)}
            self._rebuild(self._proposed or sorted(last_seen, key=last_seen.__getitem__))
            self._reset_counts_for_layout()
            for i in sorted(last_seen, key=last_seen.__getitem__):
                self._mark_ready(i, self.params[i])
        unready = [i for i, r in enumerate(self._ready) if not r]
        self._fill(unready)  # also launches what is left (everything, when recording)
        self._wait_all()
        if recording and self.static_graph:
            self._expected = list(self._arrivals)
            self._static_unused = unready
            self._static_global_unused = self._globally_unused(unready)
            unready = []
        if unready and self.static_graph:
            missing = [i for i in unready if self._expected[i] > 0]
            if missing:
                i = missing[0]
                raise graph_changed(self.names[i], self._arrivals[i], self._expected[i])
        if unready and not self.find_unused and not self.static_graph:
            raise unused([self.names[i] for i in unready], dist.get_rank())
        if self.find_unused:  # every rank takes part, whatever it saw locally
            globally_unused = self._globally_unused([i for i, u in enumerate(self._used) if not u])
            self._used = [False] * len(self.params)
        else:
            globally_unused = self._static_global_unused
        self._publish(globally_unused)

    def _reset_counts_for_layout(self) -> None:
        """After a rebuild: bucket bookkeeping for the new layout, arrivals kept."""
        self._pending = [len(b.param_indices) for b in self.buckets]
        self._futures = [None] * len(self.buckets)
        self._ready = [False] * len(self.params)
        self._seqs = [0] * len(self.buckets)
        self._next_launch = 0

    def _wait_all(self) -> None:
        start = time.perf_counter()
        self.progress.set_phase("waiting for the gradient all-reduces")
        for bucket, fut, seq in zip(self.buckets, self._futures, self._seqs):
            assert fut is not None, "every bucket is launched before backward ends"
            # A peer that never arrives is named (step, phase, alive or gone), not just timed out.
            result = hang.wait(self.progress, seq, f"DDP gradient all-reduce (bucket "
                               f"{bucket.index} of {len(self.buckets)})", fut)
            if isinstance(result, list):
                result = result[0]
            if bucket.sparse:
                if self.grad_scale != 1.0:
                    result = result * self.grad_scale
                self._sparse_grads[bucket.index] = result
            else:
                if result is not bucket.buffer:
                    bucket.buffer.copy_(result)
                if self.grad_scale != 1.0:
                    bucket.buffer.mul_(self.grad_scale)
            if self.clock is not None:
                self.clock.bucket_waited(bucket.index)
        if self.clock is not None:
            self.clock.add_exposed(time.perf_counter() - start)

    def _globally_unused(self, locally_unused: list[int]) -> set[int]:
        """Parameters no rank used; one small all-reduce."""
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.params[0].device)
        used[locally_unused] = 0
        hang.run(self.progress, "DDP unused-parameter count",
                 lambda: dist.all_reduce(used, group=self.group))
        return {i for i, count in enumerate(used.tolist()) if count == 0}

    def _publish(self, globally_unused: set[int]) -> None:
        """Make every ``.grad`` hold the mean; globally unused parameters keep what they had."""
        for bucket in self.buckets:
            if bucket.sparse:
                i = bucket.param_indices[0]
                if i not in globally_unused:
                    self.params[i].grad = self._sparse_grads[bucket.index]
                elif i in self._saved:
                    self.params[i].grad = self._saved[i]
                continue
            if not self._publish_all:
                continue
            for slot, i in enumerate(bucket.param_indices):
                param, view = self.params[i], bucket.views[slot]
                if i in globally_unused:
                    if i not in self._saved:
                        continue  # its hook ran with an undefined gradient: still None
                    old = self._saved[i]
                    if old is not None and param.grad is view:
                        view.copy_(old)  # undo the all-reduce's write into its .grad
                elif self.as_view:
                    if param.grad is not view:
                        param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)

    # ---- join --------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """Issue this iteration's collectives with zero gradients (a rank that has joined).

        Zeros go through the same comm hook, in the same bucket order, so stateful hooks and the
        peers' all-reduces see exactly the sequence they expect.
        """
        recording = not self._layout_fixed
        if recording:
            self._rebuild(self._proposed)
        last = len(self.buckets) - 1
        for bucket in self.buckets:
            grad_bucket: GradBucket
            if bucket.sparse:
                zeros = empty_sparse_grad(bucket.params[0])
                grad_bucket = SparseGradBucket(bucket.index, zeros, bucket.params[0], bucket.index == last)
            else:
                grad_bucket = GradBucket(bucket.index, torch.zeros_like(bucket.buffer),
                                         bucket.params, bucket.offsets, bucket.index == last)
            op = f"DDP gradient all-reduce (bucket {bucket.index} of {last + 1}, joined rank)"
            seq = self.progress.enter(op)
            hang.wait(self.progress, seq, op, self.comm_hook(self.comm_state, grad_bucket))
        if self.find_unused or (recording and self.static_graph):
            self._globally_unused(list(range(len(self.params))))
        self._reset_iteration()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
