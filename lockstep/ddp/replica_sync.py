"""Making every rank start from the same model: verify the parameter lists, then broadcast.

Replicas that disagree on their parameters would all-reduce mismatched buffers: at best a
hang, at worst silently wrong gradients. So construction first compares every rank's parameter
list with rank 0's and fails on every rank with the same message, naming the first difference.
The options that shape communication (``find_unused_parameters``, ``static_graph``, the bucket
size, buffer broadcasts, the reduction dtype) ride in the same exchange: given per rank, they
hung or aborted the first backward with a message that named neither the option nor the rank.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep._torch_compat import flatten_dense_tensors, unflatten_dense_tensors

__all__ = [
    "ReplicaMismatchError",
    "broadcast_coalesced",
    "broadcast_messages",
    "buffer_slots",
    "first_mismatch",
    "live_buffers",
    "option_mismatch",
    "parameter_signature",
    "verify_same_parameters",
]

# Broadcast in chunks so that a huge model never needs a second full copy in one flat buffer.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

# (name, shape, dtype) and, for parameters, requires_grad: DDP buckets the trainable ones only,
# so ranks that froze different parameters would all-reduce buckets of different sizes.
Signature = list[tuple[Any, ...]]


class ReplicaMismatchError(RuntimeError, ValueError):
    """Ranks hold different parameters, or were given different DDP options (DDP's and ZeRO's
    start-up check).

    A subclass of both :class:`RuntimeError` (what torch's DDP and ZeRO raise, so ``except
    RuntimeError`` written for torch still catches it) and :class:`ValueError` (what lockstep
    raised before, so existing handlers keep working).
    """


def parameter_signature(named_params: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    """What must agree across ranks: names, shapes, dtypes and ``requires_grad``, in order."""
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))
            for name, p in named_params]


def first_mismatch(reference: Signature, other: Signature, kind: str = "parameter") -> str | None:
    """Describe the first difference between two signatures, or ``None`` when equal.

    Args:
        kind: what the entries are, for the message ("parameter" or "buffer").
    """
    for ref, theirs in zip(reference, other):
        (ref_name, ref_shape, ref_dtype), (name, shape, dtype) = ref[:3], theirs[:3]
        if ref_name != name:
            return f"{kind} {name!r} where rank 0 has {ref_name!r}"
        if ref_shape != shape:
            return f"{kind} {name!r} has shape {list(shape)}, rank 0 has {list(ref_shape)}"
        if ref_dtype != dtype:
            return f"{kind} {name!r} has dtype {dtype}, rank 0 has {ref_dtype}"
        if ref[3:] != theirs[3:]:
            return (f"{kind} {name!r} has requires_grad={theirs[3]}, rank 0 has "
                    f"requires_grad={ref[3]} (freeze the same parameters on every rank)")
    if len(reference) != len(other):
        longer, extra = (reference, "rank 0 has") if len(reference) > len(other) else (other, "it has")
        name = longer[min(len(reference), len(other))][0]
        return (
            f"{len(other)} {kind}s, rank 0 has {len(reference)} "
            f"(first unmatched: {name!r}, which {extra})"
        )
    return None


def option_mismatch(per_rank: Sequence[Mapping[str, Any]],
                    owner: str = "DistributedDataParallel") -> str | None:
    """Describe the first option whose value differs across ranks, or ``None`` when all agree.

    Args:
        per_rank: each rank's options (name to a comparable value), in rank order.
        owner: the class named in the message.
    """
    names = list(dict.fromkeys(name for options in per_rank for name in options))
    for name in names:
        values = [options.get(name) for options in per_rank]
        if any(v != values[0] for v in values[1:]):
            by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            odd = [r for r, v in enumerate(values) if v != values[0]]
            return (
                f"{owner}: {name} differs across ranks ({by_rank}); rank(s) {odd} differ from "
                f"rank 0. {name} changes which collectives DDP runs, or their sizes, so mixed "
                "values hang or abort the first step: pass the same value on every rank."
            )
    return None


def verify_same_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
    named_buffers: Sequence[tuple[str, torch.Tensor]] = (),
    options: Mapping[str, Any] | None = None,
) -> None:
    """Raise on every rank when any rank's parameters (or buffers, or options) differ from rank 0's.

    Buffers are broadcast at construction too; one of another shape would make that broadcast
    crash the process, so they are compared in the same (single) exchange, and so are
    ``options`` (compared first: ``broadcast_buffers=False`` on one rank also empties its
    buffer list, and the option is the cause to name).

    Raises:
        ReplicaMismatchError: naming the first differing option and every rank's value, or the
            first differing rank and parameter or buffer.
    """
    mine = (parameter_signature(named_params), parameter_signature(named_buffers), dict(options or {}))
    world = dist.get_world_size(group)
    everyone: list[tuple[Signature, Signature, dict[str, Any]] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    assert all(theirs is not None for theirs in everyone)
    differs = option_mismatch([theirs[2] for theirs in everyone if theirs is not None])
    if differs is not None:
        raise ReplicaMismatchError(differs)
    reference = everyone[0]
    assert reference is not None
    for rank, theirs in enumerate(everyone[1:], start=1):
        assert theirs is not None
        for kind, ref, other in (("parameter", reference[0], theirs[0]),
                                 ("buffer", reference[1], theirs[1])):
            diff = first_mismatch(ref, other, kind)
            if diff is not None:
                raise ReplicaMismatchError(
                    f"DistributedDataParallel: rank {rank} holds different {kind}s than rank 0: "
                    f"{diff}. Every rank must build the same model (same code, same arguments) "
                    "before wrapping it."
                )


def buffer_slots(module: torch.nn.Module,
                 ignore: Collection[str] = ()) -> list[tuple[torch.nn.Module, str]]:
    """(owning module, attribute name) of every buffer whose name is not in ``ignore``: looked
    up again at each broadcast."""
    return [(owner, name) for prefix, owner in module.named_modules()
            for name, _ in owner.named_buffers(recurse=False)
            if (f"{prefix}.{name}" if prefix else name) not in ignore]


def live_buffers(slots: Sequence[tuple[torch.nn.Module, str]]) -> list[torch.Tensor]:
    """The tensors now held in ``slots`` (a buffer reassigned in ``forward`` is the new one)."""
    buffers: list[torch.Tensor] = []
    seen: set[int] = set()
    for owner, name in slots:
        buf = getattr(owner, name, None)
        if isinstance(buf, torch.Tensor) and id(buf) not in seen:
            seen.add(id(buf))
            buffers.append(buf)
    return buffers


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup
) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, few large messages, not many small."""
    is_src = dist.get_rank() == src
    for chunk in _coalesced(tensors):
        flat = flatten_dense_tensors([t.detach() for t in chunk])
        dist.broadcast(flat, src=src, group=group)
        if is_src:
            continue  # the source already holds these values
        with torch.no_grad():
            for t, synced in zip(chunk, unflatten_dense_tensors(flat, chunk)):
                t.copy_(synced)


def broadcast_messages(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of each message :func:`broadcast_coalesced` sends for ``tensors``, in order.

    One message per dtype and device (BatchNorm's float running statistics and its int64
    ``num_batches_tracked`` are two), split at :data:`BROADCAST_CHUNK_BYTES`. ``lockstep plan``
    prices DDP's buffer broadcast before every forward from these sizes.
    """
    return [sum(t.numel() * t.element_size() for t in chunk) for chunk in _coalesced(tensors)]


def _coalesced(tensors: Sequence[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """The tensors grouped by (dtype, device) in first-seen order, each group in chunks."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_key.values():
        yield from _chunks(group_tensors)


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        chunk.append(t)
        size += t.numel() * t.element_size()
        if size >= BROADCAST_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
