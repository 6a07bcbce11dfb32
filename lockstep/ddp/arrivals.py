"""When each gradient arrives at a world of one, grouped into the buckets DDP would reduce.

A world of one has no reducer (there is nothing to communicate), yet its profile is what
``lockstep plan`` predicts larger worlds from, and the planner needs to know how early in
backward each bucket would be ready to send. :class:`GradientArrivals` watches the same event
the reducer does (a parameter's gradient accumulated), fixes the bucket layout from the first
backward's arrival order with the reducer's own rule (:func:`lockstep.ddp.bucket.assign_buckets`),
and from then on tells the observer (:class:`~lockstep.ddp.observer.StepObserver`) when each
bucket's last gradient arrives, as the reducer would. Nothing is sent. (It was
``lockstep.doctor.arrivals``, which still re-exports it; DDP's side of the profile lives in DDP.)

Cost: the first backward runs a Python hook on every parameter (to learn the order); after it,
only each bucket's last-arriving parameter keeps a hook, so a model of P parameters in B buckets
pays B hooks per backward, not P (on a GPU, a world of one whose step is bound by the host's
kernel launches paid 10-20% for one hook per parameter). The layout and the ready marks assume
the arrival order the first backward showed, which is the reducer's own assumption.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from lockstep._torch_compat import queue_callback
from lockstep.ddp.bucket import BucketSpec, assign_buckets
from lockstep.ddp.observer import StepObserver

__all__ = ["GradientArrivals"]


class GradientArrivals:
    """Bucket-ready marks for a model that has no reducer.

    Args:
        params: the trainable parameters, in the model's order.
        names: their names (the profile names the last gradient of each bucket).
        cap_bytes: the bucket cap DDP would use (``bucket_cap_mb`` in bytes).
        recorder: receives :meth:`~lockstep.ddp.observer.StepObserver.bucket_ready` marks.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], cap_bytes: int,
                 recorder: StepObserver) -> None:
        if len(params) != len(names):
            raise ValueError(f"GradientArrivals: {len(params)} parameters but {len(names)} names")
        self.names = list(names)
        self._specs = [BucketSpec.of(p) for p in params]
        self._cap = cap_bytes
        self._recorder = recorder
        self._arrived: list[int] = []  # the first backward's arrivals, in order
        self._buckets: list[list[int]] = []  # empty until the first backward has been seen
        self._last_of: dict[int, int] = {}  # watched parameter -> the bucket its arrival completes
        self._in_backward = False
        self._handles = {i: p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                         for i, p in enumerate(params)}

    def layout(self) -> list[dict[str, Any]]:
        """The buckets as the recorder lists them: index, bytes and parameter names."""
        return [{"index": b, "bytes": sum(self._specs[i].numel * self._specs[i].element_size
                                          for i in members),
                 "params": [self.names[i] for i in members]}
                for b, members in enumerate(self._buckets)]

    def watched(self) -> int:
        """How many parameters run a hook each backward (every one until the first backward ends)."""
        return len(self._handles)

    def remove(self) -> None:
        """Stop watching gradients."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}

    def _on_grad(self, index: int, _param: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            queue_callback(self._backward_done)
        if not self._buckets:
            self._arrived.append(index)
            return
        bucket = self._last_of.get(index)
        if bucket is not None:
            self._recorder.bucket_ready(bucket, self.names[index])

    def _backward_done(self) -> None:
        self._in_backward = False
        if self._buckets or not self._arrived:
            return
        # The first backward fixes the layout, as the reducer's rebuild does, and which
        # parameter's arrival completes each bucket; every other hook is removed.
        order = list(dict.fromkeys(self._arrived))
        seen = set(order)
        order += [i for i in reversed(range(len(self._specs))) if i not in seen]
        self._buckets = assign_buckets(self._specs, order, self._cap)
        last_arrival = {i: k for k, i in enumerate(self._arrived)}  # a later arrival wins
        for b, members in enumerate(self._buckets):
            arrived = [i for i in members if i in seen]
            if arrived:
                self._last_of[max(arrived, key=last_arrival.__getitem__)] = b
        for i in [i for i in self._handles if i not in self._last_of]:
            self._handles.pop(i).remove()
        self._arrived = []
