"""Gradient accumulation: several micro-batches per optimizer step, one all-reduce per step.

Every backward of a :class:`~lockstep.DistributedDataParallel` model all-reduces gradients,
though only the sum over the micro-batches is needed. :func:`accumulate` runs all micro-steps
but the last inside ``no_sync()``, so gradients add up locally and the last backward averages
the sum once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

__all__ = ["accumulate"]

T = TypeVar("T")


def accumulate(model: torch.nn.Module, micro_batches: Iterable[T]) -> Iterator[T]:
    """Yield each micro-batch; all but the last are yielded inside ``model.no_sync()``.

    Run forward and backward inside the loop body (DDP decides whether to synchronise at the
    forward); step the optimizer after the loop. To equal one step on the whole batch, scale
    each micro-batch's loss by its share of the batch (``1 / len(micro_batches)`` for equal
    sizes and a mean loss). A model without ``no_sync`` (not wrapped, or a world of one) just
    gets every micro-batch.

    Args:
        model: the DDP-wrapped model (anything with a ``no_sync()`` context manager).
        micro_batches: the micro-batches of one optimizer step, any iterable.

    Yields:
        The micro-batches, in order.

    Example::

        chunks = batch.chunk(4)
        for chunk in lockstep.accumulate(ddp, chunks):
            (loss_fn(ddp(chunk)) / len(chunks)).backward()
        optimizer.step()
        optimizer.zero_grad()
    """
    no_sync = getattr(model, "no_sync", None)
    iterator = iter(micro_batches)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for upcoming in iterator:
        # Look one ahead: only when another micro-batch follows may this one skip the sync.
        context = no_sync() if no_sync is not None else contextlib.nullcontext()
        with context:
            yield current
        current = upcoming
    yield current
