"""The collectives full sharding needs, in one place, with a fallback where a backend lacks one.

Full sharding needs ``all_gather_into_tensor`` (parameters) and ``reduce_scatter_tensor``
(gradients). NCCL has both. gloo gained them late and, on some torch versions, raises for
``reduce_scatter``; there the same result is built from what every gloo has: an all-reduce of
the whole buffer, of which each rank keeps its own slice (twice the bytes of a real
reduce-scatter, still one collective). ``ReduceOp.AVG`` is not used anywhere because gloo lacks
it: gradients are divided by the group size before they are summed.

Each collective is counted in the job's progress record and waited for through
``lockstep.diagnose.hang``, so a rank that never arrives (stuck, gone, or out of the loop early)
is named on every waiting rank instead of the backend's anonymous timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress, group_progress

__all__ = ["Pending", "all_gather_into_tensor", "all_reduce", "group_size", "reduce_scatter_tensor"]


class Pending:
    """A collective in flight: :meth:`wait` finishes it (and copies out, for a fallback)."""

    def __init__(self, work: dist.Work | None, finish: torch.Tensor | None = None,
                 into: torch.Tensor | None = None,
                 named: tuple[GroupProgress, int, str] | None = None) -> None:
        self._work = work
        self._finish = finish
        self._into = into
        self._named = named  # (progress, sequence number, name): who is missing, on failure

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            if self._named is None:
                work.wait()
            else:
                progress, seq, op = self._named
                hang.wait(progress, seq, op, work)
        if self._finish is not None and self._into is not None:
            self._into.copy_(self._finish)
            self._finish = self._into = None


def _launch(group: dist.ProcessGroup | None, op: str,
            call: Callable[[], Any]) -> tuple[Any, tuple[GroupProgress, int, str]]:
    """``call()`` (which starts collective ``op``), counted; a failure names the missing ranks."""
    progress = group_progress(group)
    seq = progress.enter(op)
    return hang.call_as(progress, seq, op, call), (progress, seq, op)


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
    op = "fully_shard all-gather"
    try:
        # torch 2.13 renamed the tensor forms; older torch has only the old names.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work, named = _launch(group, op, lambda: gather(output, local, group=group, async_op=True))
    except (RuntimeError, NotImplementedError):
        # Raised at launch, before any byte moved, on every rank alike: the list all_gather.
        chunks = list(output.chunk(group_size(group)))
        work, named = _launch(group, op,
                              lambda: dist.all_gather(chunks, local, group=group, async_op=True))
    return _finished_unless(async_op, Pending(work, named=named))


def reduce_scatter_tensor(
    output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> Pending:
    """``output`` gets this rank's slice of the sum over ranks of ``send`` (size × output)."""
    size = group_size(group)
    if size == 1:
        output.copy_(send)
        return Pending(None)
    op = "fully_shard reduce-scatter"
    try:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work, named = _launch(group, op, lambda: scatter(output, send, group=group, async_op=True))
        pending = Pending(work, named=named)
    except (RuntimeError, NotImplementedError):
        # gloo without reduce_scatter (raised at launch): all-reduce everything, keep our slice
        # (see the module's docstring).
        rank = dist.get_rank(group)
        work, named = _launch(group, op,
                              lambda: dist.all_reduce(send, group=group, async_op=True))
        pending = Pending(work, finish=send.view(size, -1)[rank], into=output, named=named)
    return _finished_unless(async_op, pending)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, name: str = "fully_shard all-reduce",
) -> Pending:
    """Reduce ``tensor`` over ``group`` in place (a sum unless ``op`` says otherwise)."""
    if group_size(group) == 1:
        return Pending(None)
    work, named = _launch(group, name,
                          lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))
    return _finished_unless(async_op, Pending(work, named=named))


def _finished_unless(async_op: bool, pending: Pending) -> Pending:
    """``pending``, already waited for unless the caller asked for an asynchronous collective."""
    if not async_op:
        pending.wait()
    return pending
