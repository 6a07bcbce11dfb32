"""Copy tensors to several devices through one flat copy per device; backward sums the copies' gradients.

This is the autograd side of :func:`lockstep.dp.replicate`: the replicas' parameters (and the
buffers that require grad) lie in one flat copy per device, and the gradients that flow back
into them are summed into the originals' gradients. Each copy is a tensor of its own over its
piece of that flat copy, not a view of it: it has its own version counter, as the outputs of
torch's ``comm.broadcast_coalesced`` do (NOTE [ Version Counter in comm.*_coalesced ] in
torch/csrc/cuda/comm.cpp), so an in-place write to one copy in forward (BatchNorm's
``num_batches_tracked``, an EMA buffer, ``nn.Embedding(max_norm=...)``) neither invalidates the
others that autograd saved nor trips autograd's rule against modifying a custom Function's view
outputs (until 2026-11-29 they were views, and such forwards failed at backward). Dense
gradients travel back coalesced too (one flat copy per replica); sparse gradients
(``nn.Embedding(sparse=True)``) are summed as sparse tensors, so the original's ``.grad`` stays
sparse as it would without DataParallel.

The backward is written with ordinary differentiable operations, so ``create_graph=True``
(double backward, e.g. a gradient penalty) works through the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["broadcast_coalesced"]


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], *, share_same_device: bool
) -> list[list[torch.Tensor]]:
    """Copies of ``tensors`` (all of one dtype, on one device) on every device of ``devices``.

    Returns ``copies[d][i]``, the copy of ``tensors[i]`` on ``devices[d]``. Autograd follows the
    copies back to ``tensors`` when grad mode is on and any of them requires grad.

    Args:
        tensors: the originals, one dtype, one device.
        devices: where copies go; a device may repeat.
        share_same_device: the first copy on the originals' own device lies in the one flat
            concatenation (made anyway) rather than a further copy of it; further copies on
            that device get memory of their own, so no two replicas share memory.
    """
    if not tensors:
        return [[] for _ in devices]
    track = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if track:
        flat_out = _Broadcast.apply(tuple(devices), share_same_device, *tensors)
    else:
        flat_out = _copies(tensors, devices, share_same_device)
    n = len(tensors)
    return [list(flat_out[d * n : (d + 1) * n]) for d in range(len(devices))]


def _copies(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], share_same_device: bool
) -> tuple[torch.Tensor, ...]:
    """The copies, device after device, as one flat tuple (no autograd recorded here)."""
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    numels = [t.numel() for t in tensors]
    out: list[torch.Tensor] = []
    reusable = share_same_device
    for dev in devices:
        reuse = reusable and dev == flat.device
        reusable = reusable and not reuse  # a second replica on this device gets its own memory
        copy = flat if reuse else flat.to(dev, non_blocking=True, copy=True)
        # ``.data``: the same memory as the piece, but a tensor of its own (not a view) with a
        # version counter of its own; costs one tensor object, no copy.
        out.extend(piece.view(t.shape).data for piece, t in zip(copy.split(numels), tensors))
    return tuple(out)


class _Broadcast(torch.autograd.Function):
    """Forward: :func:`_copies`. Backward: each original gets the sum of its copies' gradients."""

    @staticmethod
    def forward(ctx: Any, devices: tuple[torch.device, ...], share: bool, *tensors: torch.Tensor) -> Any:
        # A copy that took no part in the loss brings None rather than a tensor of zeros.
        ctx.set_materialize_grads(False)
        ctx.n_devices = len(devices)
        ctx.shapes = [t.shape for t in tensors]
        ctx.source = tensors[0].device
        return _copies(tensors, devices, share)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        n = len(ctx.shapes)
        by_tensor = [[grads[d * n + i] for d in range(ctx.n_devices)] for i in range(n)]
        result: list[torch.Tensor | None] = [None] * n
        dense = []
        for i, gs in enumerate(by_tensor):
            present = [g for g in gs if g is not None]
            if not present:
                continue
            if any(g.is_sparse for g in present):
                result[i] = _sum_with_sparse(present, ctx.source)
            else:
                dense.append(i)
        if dense:
            summed = _sum_dense_coalesced([by_tensor[i] for i in dense],
                                          [ctx.shapes[i] for i in dense], ctx.source)
            for i, g in zip(dense, summed):
                result[i] = g
        return (None, None, *result)


def _sum_dense_coalesced(
    by_tensor: list[list[torch.Tensor | None]], shapes: list[torch.Size], source: torch.device
) -> list[torch.Tensor]:
    """Per tensor, the sum of its dense gradients: one flat tensor per replica moved to ``source``."""
    numels = [s.numel() for s in shapes]
    total: torch.Tensor | None = None
    for d in range(len(by_tensor[0])):
        column = [gs[d] for gs in by_tensor]
        present = [g for g in column if g is not None]
        if not present:
            continue
        like = present[0]
        flat = torch.cat([
            (g if g is not None else like.new_zeros(numel)).reshape(-1)
            for g, numel in zip(column, numels)
        ]).to(source, non_blocking=True)
        total = flat if total is None else total + flat
    assert total is not None  # every tensor here has at least one gradient
    return [piece.view(shape) for piece, shape in zip(total.split(numels), shapes)]


def _sum_with_sparse(grads: list[torch.Tensor], source: torch.device) -> torch.Tensor:
    """Sum of gradients some of which are sparse: sparse stays sparse unless a dense one joins."""
    moved = [g.to(source) for g in grads]
    # dense + sparse is defined (and dense); sparse + dense is not: add dense ones first.
    moved.sort(key=lambda g: g.is_sparse)
    total = moved[0]
    for g in moved[1:]:
        total = total + g
    return total
