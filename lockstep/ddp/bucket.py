"""Where gradients are bucketed: which parameters share a flat buffer, and the buffers themselves.

All-reducing one tensor per parameter pays a latency per call; one tensor for the whole model
cannot start until backward ends. Buckets of ~25 MB are the middle ground: a bucket is reduced as
soon as its last gradient arrives, while backward goes on computing the earlier layers
(Li et al., "PyTorch Distributed", VLDB 2020). A parameter with sparse gradients
(``nn.Embedding(sparse=True)``) gets a bucket of its own: sparse tensors cannot share a flat
buffer, so its bucket holds no buffer and the gradient itself is reduced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["MB", "Bucket", "BucketSpec", "assign_buckets", "complete_order"]

MB = 1024 * 1024
# The first bucket is small so that the first all-reduce starts early in backward.
FIRST_BUCKET_BYTES = 1 * MB


@dataclass(frozen=True)
class BucketSpec:
    """A parameter as bucket assignment sees it: its size, and the buffer it may share."""

    numel: int
    element_size: int
    key: tuple  # (dtype, device): only gradients of one dtype on one device share a buffer
    sparse: bool = False  # a sparse gradient never shares a bucket

    @classmethod
    def of(cls, param: torch.Tensor, sparse: bool = False) -> BucketSpec:
        return cls(param.numel(), param.element_size(), (param.dtype, param.device), sparse)


def assign_buckets(
    specs: Sequence[BucketSpec],
    order: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Group parameter indices into buckets, visiting them in ``order``.

    Each (dtype, device) group fills its own buckets: the first up to ``first_cap_bytes``,
    the next ones up to ``cap_bytes``. A bucket closes as soon as it reaches its cap, so a
    parameter larger than the cap gets a bucket of its own, as does every sparse one.

    Returns:
        Buckets as lists of indices into ``specs``, sorted by when their first member is visited
        (the launch order, the same on every rank for the same ``order``).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {cap_bytes / MB:g} MB")
    if sorted(order) != list(range(len(specs))):
        raise ValueError("bucket order must be a permutation of the parameter indices")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    done: list[list[int]] = []
    for idx in order:
        spec = specs[idx]
        if spec.sparse:
            done.append([idx])
            continue
        bucket = open_buckets.setdefault(spec.key, [])
        bucket.append(idx)
        open_bytes[spec.key] = open_bytes.get(spec.key, 0) + spec.numel * spec.element_size
        first = closed_per_key.get(spec.key, 0) == 0
        cap = min(first_cap_bytes, cap_bytes) if first else cap_bytes
        if open_bytes[spec.key] >= cap:
            done.append(open_buckets.pop(spec.key))
            open_bytes[spec.key] = 0
            closed_per_key[spec.key] = closed_per_key.get(spec.key, 0) + 1
    done.extend(b for b in open_buckets.values() if b)
    position = {idx: pos for pos, idx in enumerate(order)}
    return sorted(done, key=lambda b: position[b[0]])


def complete_order(first: Sequence[int], count: int) -> list[int]:
    """``first``, then the other indices below ``count`` last-registered first (a rebuild's order)."""
    seen = set(first)
    return list(first) + [i for i in reversed(range(count)) if i not in seen]


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it."""

    index: int
    param_indices: list[int]
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    views: list[torch.Tensor] = field(default_factory=list)
    sparse: bool = False  # one parameter with a sparse gradient; ``buffer`` is then empty

    @classmethod
    def allocate(
        cls,
        index: int,
        param_indices: list[int],
        params: Sequence[torch.nn.Parameter],
        sparse: bool = False,
    ) -> Bucket:
        members = [params[i] for i in param_indices]
        if sparse:
            if len(members) != 1:
                raise ValueError("a sparse bucket holds exactly one parameter")
            empty = torch.empty(0, dtype=members[0].dtype, device=members[0].device)
            return cls(index, list(param_indices), members, empty, [0], [], sparse=True)
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += p.numel()
        first = members[0]
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        views = [_grad_view(buffer[o : o + p.numel()], p) for p, o in zip(members, offsets)]
        return cls(index, list(param_indices), members, buffer, offsets, views)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _grad_view(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot of a bucket, laid out as ``param`` is (torch's reducer does the same):
    a ``channels_last`` weight gets a ``channels_last`` gradient. A layout that is not dense
    and non-overlapping (a strided view as a parameter) gets a contiguous slot."""
    if param.is_contiguous() or not _dense(param):
        return flat.view_as(param)
    return flat.as_strided(param.shape, param.stride())


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides cover exactly ``numel()`` elements, each once."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
