"""Which bucket each parameter's gradient goes in, and when that layout is fixed.

Until the first synchronised backward the buckets follow reverse registration order. That
backward records the order gradients arrive in; its end rebuilds the buckets in rank 0's order
(broadcast, so every rank builds the same) and the layout is fixed from then on. Under
``torch.compile`` the graph split proposes the order instead (:meth:`BucketLayout.plan`, see
``compiled.py``), so buckets and pieces agree. With ``find_unused_parameters`` the layout is
fixed from the start: the arrival order changes between iterations, so registration order is
kept, as torch does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.ddp.bucket import Bucket, BucketSpec, assign_buckets, complete_order
from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress
from lockstep.distributed import global_rank

__all__ = ["BucketLayout"]


class BucketLayout:
    """The reducer's buckets, and the (bucket, slot) of every parameter.

    Args:
        params: trainable parameters, in registration order.
        sparse: per parameter, whether its gradient is sparse (a bucket of its own).
        cap_bytes: the size of a bucket after the first (small) one.
        fixed: the layout is final already (no order to record).
        group: the process group whose rank 0 decides the order.
        progress: the group's progress, to name a peer that never joins the order broadcast.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        sparse: Sequence[bool],
        cap_bytes: int,
        fixed: bool,
        group: dist.ProcessGroup,
        progress: GroupProgress,
    ) -> None:
        self.params = list(params)
        self.cap_bytes = cap_bytes
        self.fixed = fixed
        self.group = group
        self.progress = progress
        self._specs = [BucketSpec.of(p, s) for p, s in zip(self.params, sparse)]
        self._proposed: list[int] = []  # a layout order proposed before it is fixed (compile)
        self.buckets: list[Bucket] = []
        # Parameter index -> (bucket index, slot in that bucket).
        self.where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        self.build(list(reversed(range(len(self.params)))))

    def build(self, order: list[int]) -> None:
        """(Re)allocate bucket buffers for ``order`` (kept when the assignment is unchanged)."""
        assignment = assign_buckets(self._specs, order, self.cap_bytes)
        if self.buckets and assignment == [b.param_indices for b in self.buckets]:
            return
        self.buckets = [
            Bucket.allocate(b, idx, self.params, sparse=self._specs[idx[0]].sparse)
            for b, idx in enumerate(assignment)
        ]
        self.where = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.where[i] = (bucket.index, slot)

    def fix(self, arrival: list[int]) -> None:
        """Rebuild in rank 0's order and fix the layout (broadcast: every rank builds the same).

        The order is the one proposed through :meth:`plan`, if any, else ``arrival`` (the order
        gradients arrived in on this rank; only rank 0's counts).
        """
        order = torch.tensor(complete_order(self._proposed or arrival, len(self.params)),
                             dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            order = order.to(self.params[0].device)
        src = global_rank(self.group, 0)
        hang.run(self.progress, "DDP bucket-order broadcast",
                 lambda: dist.broadcast(order, src=src, group=self.group))
        self.build(order.cpu().tolist())
        self.fixed = True

    def plan(self, order: Sequence[int]) -> list[list[int]]:
        """The buckets (parameter indices, launch order) for gradients finishing in ``order``.

        Before the layout is fixed, ``order`` is what the first synchronised backward builds its
        buckets in, instead of the order it records (torch.compile's graph split proposes it:
        see ``compiled.py``); orders proposed later (a second graph, later in forward) go first.
        Once fixed, the fixed buckets are returned.
        """
        if self.fixed:
            return [list(b.param_indices) for b in self.buckets]
        known = set(self._proposed)
        self._proposed = [i for i in order if i not in known] + self._proposed
        return assign_buckets(self._specs, complete_order(self._proposed, len(self.params)),
                              self.cap_bytes)
