"""Where gradients are reduced: per-parameter readiness, bucket launches, the end of backward.

Each trainable parameter has a post-accumulate-grad hook. When a parameter's gradient is final
for this backward pass, its hook marks it ready in its bucket; when a bucket's last parameter is
ready, that bucket — and any later ones already complete — is handed to the comm hook, which
starts an asynchronous all-reduce at once. Buckets launch strictly in index order so every rank
issues the same collectives in the same order. A callback queued on the autograd engine runs
when backward ends: it waits for what is still in flight, and only that wait is "exposed"
communication.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from lockstep import collective_checks, hang
from lockstep.ddp.bucket import Bucket, BucketSpec, assign_buckets
from lockstep.ddp.comm_hooks import GradBucket, allreduce_hook
from lockstep.ddp.timing import StepClock
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
        gradient_as_bucket_view: make each ``.grad`` a view of its bucket (no second copy).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.cap_bytes = bucket_cap_bytes
        self.comm_hook: Callable[[Any, GradBucket], torch.futures.Future] = allreduce_hook
        self.comm_state: Any = group
        self.clock: StepClock | None = None
        # Set by join(): rescales the mean when it must be over the active ranks only.
        self.grad_scale = 1.0
        # LOCKSTEP_DEBUG_COLLECTIVES=1: before each bucket, check every rank reduces the same one.
        self._debug = collective_checks.debug_collectives_enabled()
        # Step, phase and collective counts for naming a peer that never arrives (memory only).
        self.progress = GroupProgress(group)
        self._specs = [BucketSpec.of(p) for p in self.params]
        self._rebuilt = False
        self._arrival: list[int] = []
        self.buckets: list[Bucket] = []
        self._build(list(reversed(range(len(self.params)))))
        self._active = False
        self._reset_iteration()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # ---- buckets -------------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """(Re)allocate bucket buffers for ``order``, carrying current gradients over."""
        assignment = assign_buckets(self._specs, order, self.cap_bytes)
        if self.buckets and assignment == [b.param_indices for b in self.buckets]:
            return
        self.buckets = [Bucket.allocate(i, idx, self.params) for i, idx in enumerate(assignment)]
        self._where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket.index, slot)
                grad = self.params[i].grad
                if grad is not None and self.as_view:
                    # Keep the value, move the storage: .grad becomes a view of the new bucket.
                    bucket.views[slot].copy_(grad)
                    self.params[i].grad = bucket.views[slot]

    def _rebuild_in_arrival_order(self) -> None:
        """Rebuild buckets in the order gradients arrived in the first iteration.

        Rank 0's order is broadcast so that every rank builds identical buckets even if
        arrival differed (e.g. parameters unused on one rank only).
        """
        seen = set(self._arrival)
        rest = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = torch.tensor(self._arrival + rest, dtype=torch.int64)
        device = self.params[0].device
        if dist.get_backend(self.group) == "nccl":
            order = order.to(device)
        src = dist.get_global_rank(self.group, 0)
        hang.run(self.progress, "DDP bucket-order broadcast",
                 lambda: dist.broadcast(order, src=src, group=self.group))
        self._build(order.cpu().tolist())
        self._rebuilt = True
        self._arrival = []

    # ---- per-iteration state -------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._pending = [len(b.param_indices) for b in self.buckets]
        self._ready = [False] * len(self.params)
        self._futures: list[torch.futures.Future | None] = [None] * len(self.buckets)
        self._seqs = [0] * len(self.buckets)
        self._next_launch = 0
        self._callback_queued = False

    def prepare_for_backward(self, sync: bool) -> None:
        """Called at the end of each forward: whether the coming backward synchronises."""
        if self._callback_queued:
            # A previous backward died half-way (an exception inside it): let its all-reduces
            # finish writing into the buckets before they are reused, then start clean.
            for fut in self._futures:
                if fut is not None:
                    try:
                        fut.wait()
                    except Exception:  # noqa: BLE001 - that iteration already failed
                        logger.debug("all-reduce of an abandoned backward failed", exc_info=True)
            self._reset_iteration()
            if not self._rebuilt:
                self._arrival = []
        self._active = sync
        self.progress.begin_step("after forward, before backward")

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._active:
                self._mark_ready(i, param)

        return hook

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finalize)
            self._callback_queued = True
            self.progress.set_phase("backward")
            if self.clock is not None:
                self.clock.backward_started()
        if self._ready[i]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[i]!r} received its gradient twice "
                "in one backward pass (reentrant activation checkpointing, or the same parameter "
                "reached through two backward calls). Use non-reentrant checkpointing "
                "(use_reentrant=False), or one backward per forward."
            )
        self._ready[i] = True
        if not self._rebuilt:
            self._arrival.append(i)
        b, slot = self._where[i]
        view = self.buckets[b].views[slot]
        grad = param.grad
        if grad is not view:
            # .grad was reset to None (zero_grad) and autograd made a fresh tensor: copy it in
            # once and, in view mode, point .grad back at the bucket.
            view.copy_(grad)
            if self.as_view:
                param.grad = view
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        last = len(self.buckets) - 1
        while self._next_launch <= last and self._pending[self._next_launch] == 0:
            bucket = self.buckets[self._next_launch]
            grad_bucket = GradBucket(
                bucket.index, bucket.buffer, bucket.params, bucket.offsets, bucket.index == last
            )
            if self._debug:
                collective_checks.check_collective(
                    f"all_reduce(bucket {bucket.index})", [bucket.buffer], self.group
                )
            op = f"DDP gradient all-reduce (bucket {bucket.index})"
            seq = self._seqs[bucket.index] = self.progress.enter(op)
            self._futures[bucket.index] = hang.call_as(
                self.progress, seq, op, partial(self.comm_hook, self.comm_state, grad_bucket))
            self._next_launch += 1

    # ---- end of backward -----------------------------------------------------------------
    def _fill_unready(self, unready: list[int]) -> dict[int, torch.Tensor | None]:
        """Give parameters without a gradient this pass their slot; remember their old .grad."""
        saved: dict[int, torch.Tensor | None] = {}
        for i in unready:
            param, (b, slot) = self.params[i], self._where[i]
            view = self.buckets[b].views[slot]
            if self.find_unused:  # globally unused parameters get this back
                saved[i] = None if param.grad is None else param.grad.detach().clone()
            if param.grad is None:
                view.zero_()
            elif param.grad is not view:
                view.copy_(param.grad)
            self._ready[i] = True
            self._pending[b] -= 1
        self._launch_ready()
        return saved

    def _wait_all(self) -> None:
        start = time.perf_counter()
        self.progress.set_phase("waiting for the gradient all-reduces")
        for bucket, fut, seq in zip(self.buckets, self._futures, self._seqs):
            # A peer that never arrives is named (step, phase, alive or gone), not just timed out.
            result = hang.wait(self.progress, seq, f"DDP gradient all-reduce (bucket "
                               f"{bucket.index} of {len(self.buckets)})", fut)
            if isinstance(result, list):
                result = result[0]
            if result is not bucket.buffer:
                bucket.buffer.copy_(result)
            if self.grad_scale != 1.0:
                bucket.buffer.mul_(self.grad_scale)
        if self.clock is not None:
            self.clock.add_exposed(time.perf_counter() - start)

    def _finalize(self) -> None:
        unready = [i for i, r in enumerate(self._ready) if not r]
        try:
            saved = self._fill_unready(unready)
            self._wait_all()
            if unready and not self.find_unused:
                names = [self.names[i] for i in unready]
                if not self._rebuilt:
                    self._rebuild_in_arrival_order()  # peers are in it: keep them in step
                raise RuntimeError(
                    f"DistributedDataParallel: rank {dist.get_rank()} computed no gradient for "
                    f"{len(names)} parameter(s) in this backward pass: {names[:10]}"
                    f"{' ...' if len(names) > 10 else ''}. Make every parameter take part in the "
                    "loss, freeze the ones you don't train (requires_grad=False) before wrapping, "
                    "or pass find_unused_parameters=True."
                )
            # Every rank takes part in the used-count all-reduce, whatever it saw locally.
            globally_unused = self._globally_unused(unready) if self.find_unused else set()
            if unready or not self.as_view:
                self._publish_gradients(saved, globally_unused)
            if not self._rebuilt:
                self._rebuild_in_arrival_order()
        finally:
            self._active = False
            self._reset_iteration()  # after a rebuild: sized for the new buckets
            self.progress.set_phase("after backward (optimizer step, data loading, next forward)")
        if self.clock is not None:
            self.clock.backward_ended()

    def _globally_unused(self, unready: list[int]) -> set[int]:
        """Parameters no rank used; one small all-reduce, only with find_unused_parameters."""
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.params[0].device)
        used[unready] = 0
        hang.run(self.progress, "DDP unused-parameter count",
                 lambda: dist.all_reduce(used, group=self.group))
        return {i for i, count in enumerate(used.tolist()) if count == 0}

    def _publish_gradients(
        self, saved: dict[int, torch.Tensor | None], globally_unused: set[int]
    ) -> None:
        """Make every ``.grad`` hold the mean; globally unused parameters keep what they had."""
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                param, view = self.params[i], bucket.views[slot]
                if i in globally_unused:
                    old = saved[i]
                    if old is None:
                        param.grad = None
                    elif param.grad is not None:
                        param.grad.copy_(old)
                    else:
                        param.grad = old
                elif self.as_view:
                    if param.grad is not view:
                        param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)

    def shadow_backward(self) -> None:
        """Issue this iteration's collectives with zero gradients (a rank that has joined).

        Zeros go through the same comm hook, in the same bucket order, so stateful hooks and the
        peers' all-reduces see exactly the sequence they expect.
        """
        last = len(self.buckets) - 1
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.buffer)
            grad_bucket = GradBucket(bucket.index, zeros, bucket.params, bucket.offsets,
                                     bucket.index == last)
            op = f"DDP gradient all-reduce (bucket {bucket.index} of {last + 1}, joined rank)"
            seq = self.progress.enter(op)
            hang.wait(self.progress, seq, op, self.comm_hook(self.comm_state, grad_bucket))
        if self.find_unused:
            self._globally_unused(list(range(len(self.params))))
        if not self._rebuilt:
            self._rebuild_in_arrival_order()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
