"""Activations forward and gradients back between the ranks of neighbouring stages.

Activations can change shape from one micro-batch to the next (the last micro-batch may be
smaller), so each forward transfer sends a small int64 header ahead: how many tensors, and the
dtype and shape of each. The receiver allocates exactly that and receives into it. Gradients
need no header: they have the shapes of the outputs the receiving stage sent.

Sends are asynchronous (``isend``) and finished with :func:`wait_all` at the end of a step, so
a stage never blocks on a neighbour that is busy sending to it: the only blocking calls are
receives, which a valid schedule always satisfies.

A transfer the backend gives up on (a neighbour stuck, gone, or out of the loop early) fails
naming that neighbour (``lockstep.diagnose.hang.from_peer``), not with the backend's anonymous
timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from lockstep.diagnose import hang

__all__ = [
    "recv_grads",
    "recv_tensors",
    "send_grads",
    "send_tensors",
    "send_tensors_recv_grads",
    "wait_all",
]

# Codes for the header; the order is part of the wire format.
_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
]
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
# Tags keep the two directions apart where a backend matches messages by tag (gloo).
_FORWARD_TAG, _BACKWARD_TAG = 0, 1


def _header(tensors: Sequence[torch.Tensor]) -> list[int]:
    header = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODES:
            raise TypeError(f"cannot send a {t.dtype} tensor between pipeline stages")
        header += [_CODES[t.dtype], t.dim(), *t.shape]
    return header


def _activation_payload(
    tensors: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """What goes over the wire for an activation tuple: size, header, then each tensor."""
    header = _header(tensors)
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    meta = torch.tensor(header, dtype=torch.int64, device=device)
    return [size, meta] + [t.contiguous() for t in tensors]


def send_tensors(
    tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None, device: torch.device
) -> list:
    """Start sending ``tensors`` (an activation tuple) to global rank ``dst``, header first.

    Returns:
        The pending works; keep them (and so the tensors) alive until :func:`wait_all`.
    """
    payload = _activation_payload(tensors, device)
    what = f"pipeline: sending activations to rank {dst}"
    # The tensors travel with the works so nothing is freed before the send completes. A send
    # can fail as it starts (the peer's connection closed): named like a failed receive.
    return [(hang.from_peer(dst, what, partial(dist.isend, t, dst, group=group, tag=_FORWARD_TAG)),
             payload, dst) for t in payload]


def send_tensors_recv_grads(
    tensors: Sequence[torch.Tensor],
    slots: Sequence[tuple[torch.Size, torch.dtype]],
    peer: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[list, tuple[torch.Tensor, ...]]:
    """Send an activation tuple to ``peer`` and receive gradients from it, as one batch.

    In 1F1B steady state a stage sends micro-batch ``k`` forward while its neighbour sends the
    gradient of an older one back. Backends that run one pair's messages in order on one stream
    (NCCL) deadlock if each side's send waits for the other's receive; issued together, they
    progress together (Megatron-LM's ``send_forward_recv_backward`` does the same).

    Returns:
        The pending sends (for :func:`wait_all`) and the received gradients.
    """
    keep = _activation_payload(tensors, device)
    grads = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in slots)
    ops = [dist.P2POp(dist.isend, t, peer, group, _FORWARD_TAG) for t in keep]
    ops += [dist.P2POp(dist.irecv, g, peer, group, _BACKWARD_TAG) for g in grads]
    what = f"pipeline: receiving gradients from rank {peer}"
    works = hang.from_peer(peer, what, partial(dist.batch_isend_irecv, ops))
    sends = len(ops) - len(grads)
    if len(works) == len(ops):  # one work per message: leave the sends running
        for work in works[sends:]:
            hang.from_peer(peer, what, work.wait)
        return [(work, keep, peer) for work in works[:sends]], grads
    for work in works:  # one work for the whole batch (NCCL coalescing)
        hang.from_peer(peer, what, work.wait)
    return [], grads


def recv_tensors(
    src: int, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Receive an activation tuple from global rank ``src``, as sent by :func:`send_tensors`."""
    what = f"pipeline: receiving activations from rank {src}"
    size = torch.empty(1, dtype=torch.int64, device=device)
    hang.from_peer(src, what, partial(dist.recv, size, src, group=group, tag=_FORWARD_TAG))
    meta = torch.empty(int(size.item()), dtype=torch.int64, device=device)
    hang.from_peer(src, what, partial(dist.recv, meta, src, group=group, tag=_FORWARD_TAG))
    header = meta.tolist()
    tensors, pos = [], 1
    for _ in range(header[0]):
        code, ndim = header[pos], header[pos + 1]
        shape = header[pos + 2: pos + 2 + ndim]
        pos += 2 + ndim
        t = torch.empty(shape, dtype=_DTYPES[code], device=device)
        hang.from_peer(src, what, partial(dist.recv, t, src, group=group, tag=_FORWARD_TAG))
        tensors.append(t)
    return tuple(tensors)


def send_grads(grads: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None) -> list:
    """Start sending gradients back to global rank ``dst`` (no header: it knows their shapes)."""
    what = f"pipeline: sending gradients to rank {dst}"
    return [(hang.from_peer(dst, what, partial(dist.isend, g.contiguous(), dst, group=group,
                                               tag=_BACKWARD_TAG)), g, dst) for g in grads]


def recv_grads(
    slots: Sequence[tuple[torch.Size, torch.dtype]],
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Receive one gradient per ``(shape, dtype)`` slot from global rank ``src``."""
    grads = []
    what = f"pipeline: receiving gradients from rank {src}"
    for shape, dtype in slots:
        g = torch.empty(shape, dtype=dtype, device=device)
        hang.from_peer(src, what, partial(dist.recv, g, src, group=group, tag=_BACKWARD_TAG))
        grads.append(g)
    return tuple(grads)


def wait_all(pending: list) -> None:
    """Finish every send started with :func:`send_tensors` or :func:`send_grads`."""
    for work, _, peer in pending:
        hang.from_peer(peer, f"pipeline: sending to rank {peer}", work.wait)
    pending.clear()
