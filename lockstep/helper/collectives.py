"""Metric all-reduce and evaluation gathering, the two collectives every training script writes.

Both take ``group=None`` (the default group) and a ``device`` for the collective itself, since
NCCL only moves CUDA tensors while gloo is happiest with CPU ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress

__all__ = ["Metric", "all_reduce_metrics", "gather_for_eval"]

Metric = torch.Tensor | float | int
_OPS = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _restore(reduced: torch.Tensor, original: Metric, op: str) -> Metric:
    if not isinstance(original, torch.Tensor):
        return reduced.item()
    out = reduced.reshape(original.shape)
    # A mean of integers is not an integer; everything else keeps its dtype and device.
    if op == "mean" and not original.is_floating_point():
        return out.to(original.device)
    return out.to(device=original.device, dtype=original.dtype)


def _flat(name: str, value: object, device: torch.device | str) -> torch.Tensor:
    label = f"metric {name!r}" if name else "the metric"
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    else:
        try:  # Python and NumPy numbers, 0-d arrays
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"all_reduce_metrics: {label} is a {type(value).__name__}; pass a tensor, a "
                "number, or a dict of them"
            ) from None
    if tensor.is_complex():
        raise TypeError(f"all_reduce_metrics: {label} is complex; reduce its real and imaginary "
                        "parts as two metrics")
    source = tensor if isinstance(value, torch.Tensor) else value  # a Python float stays exact
    return torch.as_tensor(source, dtype=torch.float64).reshape(-1).to(device)


def all_reduce_metrics(
    value: Metric | Mapping[str, Metric],
    op: str = "mean",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Metric | dict[str, Metric]:
    """Reduce a metric (or a dict of them) over the ranks of ``group`` in one collective.

    Args:
        value: a tensor, a Python number, or a mapping of names to either.
        op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
        group: the process group; ``None`` is the default group.
        device: where the collective runs (a CUDA device with NCCL).

    Returns:
        The same structure: numbers come back as floats, tensors with their shape and device.
        Everything is reduced in float64, so integers are exact up to 2**53.

    Raises:
        ValueError: an unknown ``op``.
        TypeError: a value that is not a number or a real tensor (naming it).
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    items = dict(value) if isinstance(value, Mapping) else {"": value}
    flat = [_flat(name, v, device) for name, v in items.items()]
    # One float64 collective for everything: a metric may be an int on one rank and a float on
    # another (a rank with no batches keeps its ``0``), so every rank packs the same layout.
    packed = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=device)
    hang.run(group_progress(group), f"metric all-reduce ({op})",
             lambda: dist.all_reduce(packed, op=_OPS[op], group=group))
    if op == "mean":
        packed /= dist.get_world_size(group)
    parts = packed.split([t.numel() for t in flat])
    out = {name: _restore(part, items[name], op) for name, part in zip(items, parts)}
    return out if isinstance(value, Mapping) else out[""]


def gather_for_eval(
    tensor: torch.Tensor,
    total: int | Sized,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Gather per-sample results from every rank, in sampler order, without the padding.

    Each rank passes the results of its whole shard of a :class:`lockstep.DistributedSampler`
    (one row per sample, in the order the sampler gave them). Rank ``r``'s ``j``-th sample is
    position ``j * world + r`` of the sampler's global order, so interleaving the ranks restores
    that order; positions past the dataset's length are the sampler's padded repeats and are
    dropped. With ``shuffle=False`` the result is in dataset order.

    Args:
        tensor: this rank's results, first dimension one row per sample.
        total: the dataset (or its length).
        group: the process group; ``None`` is the default group.
        device: where the collective runs (a CUDA device with NCCL).

    Returns:
        A tensor of ``min(len(dataset), world * rows)`` rows, on ``tensor``'s device.

    Raises:
        TypeError: ``tensor`` is not a tensor (gather each entry of a dict or tuple on its own).
        ValueError: ranks passed different numbers of rows or different row shapes, or fewer
            rows than a whole shard (results gathered batch by batch: concatenate them first).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        got = "a 0-d tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
        raise TypeError(
            f"gather_for_eval takes one tensor with a row per sample, got {got}: gather each "
            "entry of a dict or tuple on its own, and stack per-sample scalars into rows"
        )
    world = dist.get_world_size(group)
    shapes: list[tuple[int, ...] | None] = [None] * world
    progress = group_progress(group)
    hang.run(progress, "gather_for_eval shapes",
             lambda: dist.all_gather_object(shapes, tuple(tensor.shape), group=group))
    if len(set(shapes)) != 1:
        raise ValueError(
            f"gather_for_eval needs the same shape on every rank, got {shapes} by rank: give "
            "each rank an equal shard (lockstep.DistributedSampler does) and pass all of it"
        )
    length = len(total) if hasattr(total, "__len__") else int(total)
    rows = tensor.shape[0]
    if rows * world < length - (world - 1):  # a DistributedSampler shard, drop_last or not
        raise ValueError(
            f"gather_for_eval got {rows} row{'s' * (rows != 1)} per rank, but {length} samples over {world} ranks "
            f"make shards of {-(-length // world)} (or {length // world} with drop_last): pass "
            "the results of the whole shard at once (torch.cat the batches first), since the "
            "padding to drop is at the end of the pass; to gather only part of a pass, pass "
            f"total={rows * world}"
        )
    local = tensor.detach().to(device).contiguous()
    gathered = [torch.empty_like(local) for _ in range(world)]
    hang.run(progress, "gather_for_eval all-gather",
             lambda: dist.all_gather(gathered, local, group=group))
    # stack -> [world, rows, ...]; transposing interleaves ranks back into sampler order.
    ordered = torch.stack(gathered).transpose(0, 1).reshape(-1, *local.shape[1:])
    return ordered[:length].to(tensor.device)
