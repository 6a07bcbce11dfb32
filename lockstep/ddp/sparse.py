"""Sparse gradients in DDP: which parameters have them, and how their bucket looks to a comm hook.

``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` produce sparse COO gradients:
the rows of the rows looked up, not the whole table. They cannot be copied into a flat dense
bucket, so each gets a bucket of its own whose "buffer" is the sparse gradient itself; the
comm hook reduces it (an all-reduce of a sparse tensor: gloo gathers indices and values), and
``.grad`` stays sparse, holding the mean — as torch's DDP does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lockstep.comm.hooks import GradBucket

__all__ = ["SparseGradBucket", "empty_sparse_grad", "expects_sparse_gradients", "sparse_grad_of"]


def expects_sparse_gradients(module: nn.Module, params: Sequence[nn.Parameter]) -> list[bool]:
    """For each of ``params``: does a sparse embedding of ``module`` own it (as torch decides)."""
    sparse_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }
    return [id(p) in sparse_ids for p in params]


class SparseGradBucket(GradBucket):
    """The bucket of one parameter with a sparse gradient: ``buffer()`` is that gradient."""

    def __init__(self, index: int, grad: torch.Tensor, param: nn.Parameter, is_last: bool) -> None:
        super().__init__(index, grad, [param], [0], is_last)

    def gradients(self) -> list[torch.Tensor]:
        return [self.buffer()]

    def set_buffer(self, tensor: torch.Tensor) -> None:
        raise RuntimeError(
            "GradBucket.set_buffer: this bucket holds a sparse gradient, which cannot be "
            "overwritten in place; return the new tensor from the comm hook's future instead."
        )


def empty_sparse_grad(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no rows, laid out as an embedding's (one sparse dimension)."""
    dense_shape = tuple(param.shape[1:])
    indices = torch.empty(1, 0, dtype=torch.int64, device=param.device)
    values = torch.empty((0, *dense_shape), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, tuple(param.shape), check_invariants=True)


def sparse_grad_of(param: torch.Tensor, name: str) -> torch.Tensor:
    """The sparse gradient to reduce for ``param``; an empty one when it has none."""
    grad = param.grad
    if grad is None:
        return empty_sparse_grad(param)
    if not grad.is_sparse:
        raise RuntimeError(
            f"DistributedDataParallel: parameter {name!r} belongs to a sparse embedding "
            "(sparse=True) but received a dense gradient. Do not change an embedding's sparse "
            "flag after wrapping the model; wrap it again instead."
        )
    return grad
