"""How far the training loop has really read a sampler, when a ``DataLoader`` reads it.

A ``DataLoader`` with worker processes draws indices from its sampler ahead of the loop
(``prefetch_factor`` batches per worker), so a sampler that counts what it has yielded counts
batches the loop has not trained on yet; a checkpoint saved from that count resumes after them
and those samples are never trained on. :class:`LoaderPosition` finds the ``DataLoader``
iterator that is reading a sampler (once per pass, when the sampler yields its first index)
and answers with the batches that iterator has handed to the loop instead. Samplers use it in
their ``state_dict()``; nothing else needs to change in a training script.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

from torch.utils.data import BatchSampler

from lockstep._torch_compat import is_loader_iterator, loader_batches_yielded, loader_index_sampler

__all__ = ["LoaderPosition"]

# Frames between a sampler's generator and the DataLoader iterator's method that advanced it
# (a BatchSampler's generator, then ``_next_index``; a few more at the iterator's first fill).
_FRAMES_UP = 8


class LoaderPosition:
    """The batches a ``DataLoader`` iterator reading one sampler has given the training loop.

    Args:
        iterator: the ``DataLoader`` iterator.
        per_batch: the sampler's yields in one of its batches (``batch_size`` when a
            ``BatchSampler`` groups them, 1 when the sampler is the batch sampler itself or
            the loader does not batch).
        drop_last: the ``BatchSampler`` drops a last, incomplete batch.
    """

    def __init__(self, iterator: object, per_batch: int, drop_last: bool) -> None:
        self.per_batch = per_batch
        self.drop_last = drop_last
        self._iterator = weakref.ref(iterator)
        self._final: int | None = None
        # When the loop drops the iterator (a ``break``, the end of the loop), keep its count:
        # a checkpoint saved after the loop still resumes where it stopped.
        weakref.finalize(iterator, self._remember, vars(iterator))

    def _remember(self, state: dict[str, Any]) -> None:
        self._final = loader_batches_yielded(state)

    @classmethod
    def of_caller(cls, sampler: object) -> LoaderPosition | None:
        """The position of the ``DataLoader`` iterator that is advancing ``sampler``'s iterator.

        Call it from inside the sampler's generator; ``None`` when no ``DataLoader`` is reading
        it (``list(sampler)``), or when one reads it through a batch sampler other than torch's
        ``BatchSampler`` (its batches' sizes are not known, so the yields cannot be mapped).
        """
        frame: FrameType | None = sys._getframe(2)  # the caller of the sampler's generator
        for _ in range(_FRAMES_UP):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if owner is not None and is_loader_iterator(owner):
                return cls._reading(owner, sampler)
            frame = frame.f_back
        return None

    @classmethod
    def _reading(cls, iterator: object, sampler: object) -> LoaderPosition | None:
        index_sampler = loader_index_sampler(vars(iterator))
        if index_sampler is sampler:
            return cls(iterator, 1, False)
        if isinstance(index_sampler, BatchSampler) and index_sampler.sampler is sampler:
            return cls(iterator, index_sampler.batch_size, index_sampler.drop_last)
        return None

    def batches(self) -> int | None:
        """Batches handed to the loop so far, or ``None`` if that is no longer known."""
        iterator = self._iterator()
        if iterator is None:
            return self._final
        return loader_batches_yielded(vars(iterator))

    def used(self, yielded: int, finished: bool) -> int:
        """Of ``yielded`` indices the sampler gave the loader, how many the loop has received.

        Args:
            yielded: indices the sampler has yielded in this pass.
            finished: the sampler's pass is over (everything was read).
        """
        batches = self.batches()
        if batches is None:
            return yielded
        received = batches * self.per_batch
        if finished and self.drop_last and received >= yielded - yielded % self.per_batch:
            return yielded  # every whole batch trained on: only the dropped tail is left
        return min(yielded, received)
