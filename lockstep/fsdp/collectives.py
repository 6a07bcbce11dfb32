"""The collectives full sharding needs, in one place, with a fallback where a backend lacks one.

Full sharding needs ``all_gather_into_tensor`` (parameters) and ``reduce_scatter_tensor``
(gradients). NCCL has both. gloo gained them late and, on some torch versions, raises for
``reduce_scatter``; there the same result is built from what every gloo has: an all-reduce of
the whole buffer, of which each rank keeps its own slice (twice the bytes of a real
reduce-scatter, still one collective). ``ReduceOp.AVG`` is not used anywhere because gloo lacks
it: gradients are divided by the group size before they are summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Pending", "all_gather_into_tensor", "all_reduce", "group_size", "reduce_scatter_tensor"]


class Pending:
    """A collective in flight: :meth:`wait` finishes it (and copies out, for a fallback)."""

    def __init__(self, work: dist.Work | None, finish: torch.Tensor | None = None,
                 into: torch.Tensor | None = None) -> None:
        self._work = work
        self._finish = finish
        self._into = into

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None and self._into is not None:
            self._into.copy_(self._finish)
            self._finish = self._into = None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_gather_into_tensor(
    output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> Pending:
    """``output`` (group size × ``local.numel()``) gets every rank's ``local``, in rank order."""
    if group_size(group) == 1:
        output.copy_(local)
        return Pending(None)
    try:
        # torch 2.13 renamed the tensor forms; older torch has only the old names.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(output, local, group=group, async_op=async_op)
        return Pending(work)
    except (RuntimeError, NotImplementedError):
        # Raised before any byte moved, on every rank alike: fall back to list all_gather.
        chunks = list(output.chunk(group_size(group)))
        work = dist.all_gather(chunks, local, group=group, async_op=async_op)
        return Pending(work)


def reduce_scatter_tensor(
    output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> Pending:
    """``output`` gets this rank's slice of the sum over ranks of ``send`` (size × output)."""
    size = group_size(group)
    if size == 1:
        output.copy_(send)
        return Pending(None)
    try:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = scatter(output, send, group=group, async_op=async_op)
        return Pending(work)
    except (RuntimeError, NotImplementedError):
        # gloo without reduce_scatter: all-reduce everything, keep our slice (see module doc).
        rank = dist.get_rank(group)
        work = dist.all_reduce(send, group=group, async_op=async_op)
        mine = send.view(size, -1)[rank]
        pending = Pending(work, finish=mine, into=output)
        if not async_op:
            pending.wait()
        return pending


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> Pending:
    """Sum ``tensor`` over ``group`` in place."""
    if group_size(group) == 1:
        return Pending(None)
    return Pending(dist.all_reduce(tensor, group=group, async_op=async_op))
