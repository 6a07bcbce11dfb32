"""Metric all-reduce and evaluation gathering, the two collectives every training script writes.

Both take ``group=None`` (the default group) and a ``device`` for the collective itself, since
NCCL only moves CUDA tensors while gloo is happiest with CPU ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sized

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress, group_progress

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


def _fingerprint(layout: list[tuple[str, int]]) -> int:
    # A hash that is the same in every process (``hash()`` of a str is salted per process),
    # kept below 2**62 so that its negation fits an int64 too.
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _layout_differences(layouts: list[list[tuple[str, int]]]) -> str:
    """Name the ranks and the metrics on which ``layouts`` (one per rank) disagree."""
    names = [dict(layout) for layout in layouts]
    every = sorted({name for per_rank in names for name in per_rank}, key=repr)
    parts = []
    for name in every:
        label = f"metric {name!r}" if name else "the metric"
        having = [rank for rank, per_rank in enumerate(names) if name in per_rank]
        if len(having) < len(names):
            missing = [rank for rank in range(len(names)) if rank not in having]
            parts.append(f"{label} is passed by rank{'s' * (len(having) > 1)} "
                         f"{', '.join(map(str, having))} but not by rank"
                         f"{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}")
            continue
        sizes = [per_rank[name] for per_rank in names]
        if len(set(sizes)) > 1:
            by_rank = ", ".join(f"{n} on rank {rank}" for rank, n in enumerate(sizes))
            parts.append(f"{label} has different numbers of elements: {by_rank}")
    return "; ".join(parts) or "the ranks passed the same metrics in a layout that hashes apart"


def _check_layout(
    layout: list[tuple[str, int]],
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    progress: GroupProgress,
    label: str,
) -> None:
    """Raise on every rank when the ranks' metric names or element counts differ.

    The common case costs one all-reduce of two int64s: the MAX of ``[h, -h]`` is
    ``[max h, -min h]``, equal in size only when every rank sent the same fingerprint ``h``. Only
    when they differ are the layouts gathered, to name who passed what. ``label`` names the
    check as the all-reduce it guards, so a rank that never arrives is reported at that call.
    """
    mine = _fingerprint(layout)
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    hang.run(progress, label,
             lambda: dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group))
    if int(extremes[0]) == -int(extremes[1]):
        return
    layouts: list[list[tuple[str, int]]] = [[] for _ in range(dist.get_world_size(group))]
    hang.run(progress, f"{label}: layout gather",
             lambda: dist.all_gather_object(layouts, layout, group=group))
    raise ValueError(
        f"all_reduce_metrics needs the same metrics, of the same sizes, on every rank: "
        f"{_layout_differences(layouts)}. Pass the same names, each with the same number of "
        "elements, on every rank (a rank without data passes 0, or zeros of the same size)"
    )


def all_reduce_metrics(
    value: Metric | Mapping[str, Metric],
    op: str = "mean",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Metric | dict[str, Metric]:
    """Reduce a metric (or a dict of them) over the ranks of ``group`` in one collective.

    A dict is packed in the order of its sorted names, so ranks may build it in any order; a
    reduce of two numbers before it checks that every rank passed the same names and sizes.

    Args:
        value: a tensor, a Python number, or a mapping of names to either.
        op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
        group: the process group; ``None`` is the default group.
        device: where the collective runs (a CUDA device with NCCL).

    Returns:
        The same structure: numbers come back as floats, tensors with their shape and device.
        Everything is reduced in float64, so integers are exact up to 2**53.

    Raises:
        ValueError: an unknown ``op``; ranks that passed different names, or a metric with
            different numbers of elements (on every rank, naming the ranks and metrics).
        TypeError: a value that is not a number or a real tensor (naming it).
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    items = dict(value) if isinstance(value, Mapping) else {"": value}
    # Packed in one order on every rank, whatever order each rank's dict has.
    names = sorted(items, key=repr)
    flat = [_flat(name, items[name], device) for name in names]
    # One float64 collective for everything: a metric may be an int on one rank and a float on
    # another (a rank with no batches keeps its ``0``), so the layout checked is names and sizes.
    progress, label = group_progress(group), f"metric all-reduce ({op})"
    layout = [(name, t.numel()) for name, t in zip(names, flat)]
    _check_layout(layout, group, device, progress, label)
    packed = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=device)
    hang.run(progress, label,
             lambda: dist.all_reduce(packed, op=_OPS[op], group=group))
    if op == "mean":
        packed /= dist.get_world_size(group)
    parts = dict(zip(names, packed.split([t.numel() for t in flat])))
    out = {name: _restore(parts[name], items[name], op) for name in items}
    return out if isinstance(value, Mapping) else out[""]


def _length(total: object) -> int | str:
    """``total`` as a number of samples, or why it is not one (raised after the exchange)."""
    try:
        return len(total) if isinstance(total, Sized) else int(total)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return f"a {type(total).__name__}, not a dataset or a number of samples"


_Layout = tuple[tuple[int, ...], str, int | str]  # shape, dtype, total (or why it is none)


def _agreed_length(found: list[_Layout]) -> int:
    """The total every rank passed; raise on every rank when shapes, dtypes or totals differ."""
    shapes = [shape for shape, _, _ in found]
    dtypes = [dtype for _, dtype, _ in found]
    totals = [total for _, _, total in found]
    if len(set(shapes)) != 1:
        raise ValueError(
            f"gather_for_eval needs the same shape on every rank, got {shapes} by rank: give "
            "each rank an equal shard (lockstep.DistributedSampler does) and pass all of it"
        )
    if len(set(dtypes)) != 1:
        raise ValueError(
            f"gather_for_eval needs the same dtype on every rank, got {dtypes} by rank: convert "
            f"the results to one dtype on every rank first (e.g. .to(torch.{dtypes[0]}))"
        )
    bad = [f"{total} on rank {rank}" for rank, total in enumerate(totals) if isinstance(total, str)]
    if bad:
        raise TypeError(
            f"gather_for_eval's total is {'; '.join(bad)}: pass the evaluation dataset, or its "
            "length, on every rank"
        )
    if len(set(totals)) != 1:
        raise ValueError(
            f"gather_for_eval needs the same total on every rank, got {totals} by rank: pass the "
            "whole evaluation dataset (or its length) on every rank, not the rank's shard"
        )
    return int(totals[0])


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
        ValueError: ranks passed different numbers of rows, row shapes, dtypes or totals (on
            every rank, naming them), or fewer rows than a whole shard (results gathered batch
            by batch: concatenate them first).
        TypeError: ``total`` is neither sized nor a number (on every rank, naming the rank).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        got = "a 0-d tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
        raise TypeError(
            f"gather_for_eval takes one tensor with a row per sample, got {got}: gather each "
            "entry of a dict or tuple on its own, and stack per-sample scalars into rows"
        )
    world = dist.get_world_size(group)
    # One exchange checks everything the all-gather needs to agree on: a different dtype makes
    # gloo read garbage (or abort), a different total cuts the result at another length.
    mine: _Layout = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), _length(total))
    found: list[_Layout] = [mine] * world
    progress = group_progress(group)
    hang.run(progress, "gather_for_eval shapes",
             lambda: dist.all_gather_object(found, mine, group=group))
    length = _agreed_length(found)
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
