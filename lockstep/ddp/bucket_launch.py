"""One synchronised backward's buckets: gradients in, all-reduces launched in order, the mean out.

A gradient marked ready is put in its bucket slot (in view mode it already is: ``.grad`` is the
slot). When a bucket's last slot is filled, that bucket — and any later ones already complete —
is handed to the comm hook, which starts an asynchronous all-reduce at once. Buckets launch
strictly in index order so every rank issues the same collectives in the same order. At the end
of backward the reducer waits for what is still in flight (only that wait is "exposed"
communication) and publishes the mean into every ``.grad``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.comm.hooks import GradBucket
from lockstep.ddp.bucket import Bucket
from lockstep.ddp.bucket_layout import BucketLayout
from lockstep.ddp.observer import StepObserver
from lockstep.ddp.sparse import SparseGradBucket, empty_sparse_grad, sparse_grad_of
from lockstep.ddp.streams import note_stream, wait_for_writers
from lockstep.diagnose import collective_checks, hang
from lockstep.diagnose.progress import GroupProgress

__all__ = ["BucketRound", "ReducerSettings", "launch_zeros"]

logger = logging.getLogger(__name__)


class ReducerSettings(Protocol):
    """What a round reads from its reducer, when it uses it (the wrapper, join and the profiler
    may change the hook, the scale and the clock between iterations)."""

    @property
    def params(self) -> Sequence[torch.nn.Parameter]: ...
    @property
    def names(self) -> Sequence[str]: ...
    @property
    def group(self) -> dist.ProcessGroup: ...
    @property
    def progress(self) -> GroupProgress: ...
    @property
    def as_view(self) -> bool: ...
    @property
    def comm_hook(self) -> Callable[[Any, GradBucket], torch.futures.Future]: ...
    @property
    def comm_state(self) -> Any: ...
    @property
    def clock(self) -> StepObserver | None: ...
    @property
    def grad_scale(self) -> float: ...


class BucketRound:
    """The bucket state of one synchronised backward (a fresh round for each).

    Args:
        owner: the reducer (its settings, read when used).
        layout: the bucket layout this round fills.
        debug: before each bucket, check that every rank reduces the same one.
        publish_all: write the mean into every ``.grad`` at the end (not only the sparse ones),
            i.e. ``.grad`` is not already the bucket view for every parameter.
    """

    def __init__(
        self, owner: ReducerSettings, layout: BucketLayout, debug: bool, publish_all: bool
    ) -> None:
        self._owner = owner
        self._layout = layout
        self._debug = debug
        self._publish_all = publish_all
        buckets = layout.buckets
        self._pending = [len(b.param_indices) for b in buckets]
        self._ready = [False] * len(owner.params)
        self._saved: dict[int, torch.Tensor | None] = {}
        self._sparse_grads: dict[int, torch.Tensor] = {}
        self._futures: list[torch.futures.Future | None] = [None] * len(buckets)
        self._seqs = [0] * len(buckets)
        # Per bucket, the streams its slots were written on (empty on CPU): see streams.py.
        self._writers: list[list[torch.Stream]] = [[] for _ in buckets]
        self._next_launch = 0

    def unready(self) -> list[int]:
        """Parameters not marked ready in this round."""
        return [i for i, r in enumerate(self._ready) if not r]

    def ready(self, i: int, param: torch.Tensor) -> None:
        """Mark ``param`` (index ``i``) ready; launch its bucket, and those after, if complete."""
        self.mark_ready(i, param)
        b = self._layout.where[i][0]
        if self._pending[b] == 0:
            clock = self._owner.clock
            if clock is not None:
                clock.bucket_ready(b, self._owner.names[i])
            self.launch_ready()

    def mark_ready(self, i: int, param: torch.Tensor) -> None:
        """Put ``param``'s gradient in its bucket slot (no launch)."""
        owner = self._owner
        b, slot = self._layout.where[i]
        bucket = self._layout.buckets[b]
        self._ready[i] = True
        self._pending[b] -= 1
        note_stream(self._writers[b], param.device)  # the stream this gradient was made on
        if bucket.sparse:
            self._sparse_grads[b] = sparse_grad_of(param, owner.names[i])
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
                    f"DistributedDataParallel: parameter {owner.names[i]!r} received a sparse "
                    "gradient, but only nn.Embedding/nn.EmbeddingBag(sparse=True) weights are "
                    "expected to have one. Use a dense gradient, or a sparse embedding module."
                )
            # .grad was reset to None (zero_grad) and autograd made a fresh tensor: copy it in
            # once and, in view mode, point .grad back at the bucket.
            view.copy_(grad)
            if owner.as_view:
                param.grad = view

    def fill(self, indices: list[int]) -> None:
        """Mark parameters without a gradient this pass ready; remember their ``.grad``."""
        buckets = self._layout.buckets
        for i in indices:
            param, (b, slot) = self._owner.params[i], self._layout.where[i]
            grad = param.grad
            note_stream(self._writers[b], param.device)
            if buckets[b].sparse:
                self._saved[i] = grad  # a comm hook divides its input in place: give it a copy
                self._sparse_grads[b] = empty_sparse_grad(param) if grad is None else grad.clone()
                self._ready[i] = True
                self._pending[b] -= 1
                continue
            view = buckets[b].views[slot]
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
        self.launch_ready()

    def launch_ready(self) -> None:
        """Hand complete buckets to the comm hook, strictly in index order."""
        owner, buckets = self._owner, self._layout.buckets
        last = len(buckets) - 1
        while self._next_launch <= last and self._pending[self._next_launch] == 0:
            bucket = buckets[self._next_launch]
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
                    f"all_reduce(bucket {bucket.index})", tensors, owner.group
                )
            # The all-reduce is ordered after the current stream only: first make that stream
            # wait on every other stream that wrote a slot of this bucket.
            wait_for_writers(self._writers[bucket.index], bucket.params[0].device)
            if owner.clock is not None:
                owner.clock.bucket_launched(bucket.index)
            op = f"DDP gradient all-reduce (bucket {bucket.index})"
            seq = self._seqs[bucket.index] = owner.progress.enter(op)
            self._futures[bucket.index] = fut = hang.call_as(
                owner.progress, seq, op, partial(owner.comm_hook, owner.comm_state, grad_bucket))
            if owner.clock is not None:
                owner.clock.watch_bucket(bucket.index, fut)
            self._next_launch += 1

    def abandon(self) -> None:
        """Let the all-reduces of a backward that died half-way finish writing into the buckets."""
        for fut in self._futures:
            if fut is not None:
                try:
                    fut.wait()
                except Exception:
                    logger.debug("all-reduce of an abandoned backward failed", exc_info=True)

    def wait_all(self) -> None:
        """Wait for every bucket's all-reduce and take its result (scaled by ``grad_scale``)."""
        owner, buckets = self._owner, self._layout.buckets
        start = time.perf_counter()
        owner.progress.set_phase("waiting for the gradient all-reduces")
        for bucket, fut, seq in zip(buckets, self._futures, self._seqs):
            assert fut is not None, "every bucket is launched before backward ends"
            # A peer that never arrives is named (step, phase, alive or gone), not just timed out.
            result = hang.wait(owner.progress, seq, f"DDP gradient all-reduce (bucket "
                               f"{bucket.index} of {len(buckets)})", fut)
            if isinstance(result, list):
                result = result[0]
            if bucket.sparse:
                if owner.grad_scale != 1.0:
                    result = result * owner.grad_scale
                self._sparse_grads[bucket.index] = result
            else:
                _take_result(bucket.buffer, result)
                if owner.grad_scale != 1.0:
                    bucket.buffer.mul_(owner.grad_scale)
            if owner.clock is not None:
                owner.clock.bucket_waited(bucket.index)
        if owner.clock is not None:
            owner.clock.add_exposed(time.perf_counter() - start)

    def publish(self, globally_unused: set[int]) -> None:
        """Make every ``.grad`` hold the mean; globally unused parameters keep what they had."""
        params, as_view = self._owner.params, self._owner.as_view
        for bucket in self._layout.buckets:
            if bucket.sparse:
                i = bucket.param_indices[0]
                if i not in globally_unused:
                    params[i].grad = self._sparse_grads[bucket.index]
                elif i in self._saved:
                    params[i].grad = self._saved[i]
                continue
            if not self._publish_all:
                continue
            for slot, i in enumerate(bucket.param_indices):
                param, view = params[i], bucket.views[slot]
                if i in globally_unused:
                    if i not in self._saved:
                        continue  # its hook ran with an undefined gradient: still None
                    old = self._saved[i]
                    if old is not None and param.grad is view:
                        view.copy_(old)  # undo the all-reduce's write into its .grad
                elif as_view:
                    if param.grad is not view:
                        param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)


def launch_zeros(buckets: Sequence[Bucket], owner: ReducerSettings) -> None:
    """Issue one iteration's bucket collectives with zero gradients (a rank that has joined).

    Zeros go through the same comm hook, in the same bucket order, so stateful hooks and the
    peers' all-reduces see exactly the sequence they expect.
    """
    last = len(buckets) - 1
    for bucket in buckets:
        grad_bucket: GradBucket
        if bucket.sparse:
            zeros = empty_sparse_grad(bucket.params[0])
            grad_bucket = SparseGradBucket(bucket.index, zeros, bucket.params[0], bucket.index == last)
        else:
            grad_bucket = GradBucket(bucket.index, torch.zeros_like(bucket.buffer),
                                     bucket.params, bucket.offsets, bucket.index == last)
        op = f"DDP gradient all-reduce (bucket {bucket.index} of {last + 1}, joined rank)"
        seq = owner.progress.enter(op)
        hang.wait(owner.progress, seq, op, owner.comm_hook(owner.comm_state, grad_bucket))


def _take_result(buffer: torch.Tensor, result: torch.Tensor) -> None:
    """Copy a comm hook's result into the bucket's buffer, unless it is that memory already.

    A complex bucket's hook works on its real view (``GradBucket``), and gloo's all-reduce of a
    complex tensor answers with one: the same memory under another dtype, which must not be
    copied onto itself.
    """
    if buffer.is_complex():
        buffer = torch.view_as_real(buffer).view(-1)
    if result is buffer or (result.data_ptr() == buffer.data_ptr() and result.dtype == buffer.dtype
                            and result.numel() == buffer.numel()):
        return
    buffer.copy_(result.reshape(buffer.shape))
