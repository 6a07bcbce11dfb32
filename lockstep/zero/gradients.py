"""ZeRO-2: reduce each gradient to the rank that owns its parameter, and drop it elsewhere.

An all-reduce hands every rank the whole averaged gradient, though each rank only steps its
shard. Reducing each owner's bucket to that owner instead moves about half the bytes (a
reduce-scatter rather than a reduce-scatter plus an all-gather) and leaves each rank holding
gradients for about ``1/world_size`` of the parameters between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.zero.broadcast import OwnerBucket

__all__ = ["carry_forward", "clip_owned", "grad_bytes", "reduce_to_owners"]


@torch.no_grad()
def reduce_to_owners(
    buckets: Sequence[OwnerBucket], rank: int, group: dist.ProcessGroup | None, ranks: list[int]
) -> None:
    """Average each bucket's local gradients over ranks onto its owner; others set ``grad=None``.

    A parameter without a gradient on some ranks counts as zero there; one without a gradient
    on every rank keeps ``grad=None`` (so the optimizer skips it, as it would without ZeRO).

    Args:
        buckets: the owners' buckets, in the same order on every rank.
        rank: this process's rank in ``group``.
        group: the process group (``None``: the default group).
        ranks: global rank of each group rank.

    Raises:
        RuntimeError: a parameter has a sparse gradient (only dense ones can be sharded).
    """
    params = [p for bucket in buckets for p in bucket.params]
    if not params:
        return
    present = _present_anywhere(params, group)
    world = dist.get_world_size(group)
    for bucket in buckets:
        live = [p for p in bucket.params if present[id(p)]]
        if not live:
            continue
        flat = torch.cat([_grad_or_zeros(p).reshape(-1) for p in live])
        # Divide before the sum, as the all-reduce hook does, so fp16 sums do not overflow.
        flat.div_(world)
        dist.reduce(flat, dst=ranks[bucket.owner], op=dist.ReduceOp.SUM, group=group)
        if bucket.owner == rank:
            _write_grads(flat, live)
        else:
            for p in bucket.params:
                p.grad = None


@torch.no_grad()
def carry_forward(buckets: Sequence[OwnerBucket], rank: int, world: int) -> None:
    """After a step, put the owner's averaged gradients back in the form the next reduction
    expects: this rank's share of a sum that is divided by ``world``.

    Gradients left in place (no ``zero_grad`` before the next backward) then count once, as
    torch's own optimizers and DDP count them: the next step averages ``world`` x the carried
    gradient (held by the owner alone) with the new local gradients, which gives the carried
    gradient plus the average of the new ones. Zeroed or ``None`` gradients carry nothing.
    """
    if world == 1:
        return
    for bucket in buckets:
        if bucket.owner == rank:
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.mul_(world)


@torch.no_grad()
def clip_owned(buckets: Sequence[OwnerBucket], rank: int, group: dist.ProcessGroup | None,
               max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Clip the reduced gradients (each held by its owner alone) by their global norm.

    Each rank takes the norm of the gradients it owns; one all-reduce combines them (a sum of
    p-th powers, or a max for the infinity norm), so every rank scales by the factor
    ``torch.nn.utils.clip_grad_norm_`` would use on the whole averaged gradient. Returns the norm.
    """
    device = next(p.device for bucket in buckets for p in bucket.params)
    grads = [p.grad for bucket in buckets if bucket.owner == rank for p in bucket.params
             if p.grad is not None]
    norm_type = float(norm_type)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float64) for g in grads]
    if norm_type == float("inf"):
        total = torch.stack(norms).max() if norms else torch.zeros((), dtype=torch.float64, device=device)
        op = dist.ReduceOp.MAX
    else:
        total = (torch.stack(norms).pow(norm_type).sum() if norms
                 else torch.zeros((), dtype=torch.float64, device=device))
        op = dist.ReduceOp.SUM
    total = total.to(device)
    hang.run(group_progress(group), "ZeRO gradient-norm all-reduce",
             lambda: dist.all_reduce(total, op=op, group=group))
    if norm_type != float("inf"):
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
            "clipped; set error_if_nonfinite=False to clip anyway"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)


def grad_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of the gradients these parameters hold right now."""
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def _present_anywhere(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> dict:
    """For each parameter (by id), whether any rank has a gradient for it: one small all-reduce."""
    for index, p in enumerate(params):
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(
                f"parameter {index} (shape {tuple(p.shape)}) has a sparse gradient; "
                "reduce_gradients=True needs dense gradients (e.g. nn.Embedding(sparse=False))"
            )
    flags = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.int32, device=params[0].device
    )
    hang.run(group_progress(group), "ZeRO gradient-presence all-reduce",
             lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group))
    return {id(p): bool(flag) for p, flag in zip(params, flags.tolist())}


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _write_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = chunk.view_as(p).clone()
        else:
            p.grad.copy_(chunk.view_as(p))
