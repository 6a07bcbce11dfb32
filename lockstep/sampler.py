"""DistributedSampler: each rank reads its own equal, disjoint shard of a dataset.

A drop-in for ``torch.utils.data.DistributedSampler``: same arguments, and for the same
arguments the very same indices on every rank. Beyond torch's, it resumes mid-epoch
(:meth:`DistributedSampler.state_dict` records the epoch and how many samples the whole job has
consumed, so a job may resume on a different number of ranks), and it warns once when an
epoch's shuffled order is replayed because :meth:`~DistributedSampler.set_epoch` was forgotten:
when a pass that started after a complete pass of the same epoch, or as the third pass of one
epoch (loops that stop each epoch early), runs to its end or is followed by another pass before
``set_epoch`` moves on. A peek such as ``next(iter(loader))`` before ``set_epoch`` (pytorch/examples'
DDP tutorial reads the batch size so each epoch) does not count.

How the global order is built, for epoch ``e`` and world size ``W``:

1. a permutation of the ``n`` dataset indices from ``seed + e`` (or ``0..n-1`` unshuffled);
2. after a resume, the first ``consumed`` positions of it are skipped;
3. what is left is padded up to a multiple of ``W`` by repeating the epoch's order from its
   start (so a resume on the same number of ranks pads exactly as the uninterrupted pass; on
   another number, from the start of what is left, so nothing consumed is replayed), or, with
   ``drop_last``, cut down to one;
4. rank ``r`` takes positions ``r, r + W, r + 2W, ...``.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lockstep.env import detect_process_info
from lockstep.loader_position import LoaderPosition

__all__ = ["DistributedSampler", "shard_length", "world_from_context"]


def shard_length(remaining: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank gets from ``remaining`` positions of the global order."""
    if drop_last:
        return remaining // num_replicas
    return math.ceil(remaining / num_replicas)


def world_from_context() -> tuple[int, int]:
    """(num_replicas, rank) from the default group, else from the launcher's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    info = detect_process_info()
    return info.world_size, info.rank


class DistributedSampler(Sampler[int]):
    """Restrict data loading to this rank's shard of the dataset.

    Args:
        dataset: anything with ``len()``; the sampler yields indices into it.
        num_replicas: number of ranks sharing the dataset; by default the default group's world
            size (or the launcher's ``WORLD_SIZE`` before the group exists, 1 without one).
        rank: this rank; by default the default group's rank (or ``RANK``, or 0).
        shuffle: shuffle the order, differently each epoch (see :meth:`set_epoch`).
        seed: the shuffle's seed; must be the same on every rank.
        drop_last: drop the tail so every shard has the same length, instead of padding
            with repeated indices.

    Raises:
        TypeError: ``num_replicas``, ``rank`` or ``seed`` that is not an int.
        ValueError: ``rank`` outside ``[0, num_replicas)``, an empty dataset, or fewer samples
            than ranks with ``drop_last=True``.

    Example::

        sampler = lockstep.DistributedSampler(dataset)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        checked: list[int | None] = []
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise TypeError(
                    f"{name} must be an int, got {type(value).__name__} {value!r}"
                    + (f" (pass {name}={int(value)})" if str(value).isdigit() else "")
                )
            checked.append(None if value is None else operator.index(value))  # NumPy ints too
        num_replicas, rank = checked[0], checked[1]
        seed = operator.index(seed)
        if num_replicas is None or rank is None:
            world, this_rank = world_from_context()
            num_replicas = world if num_replicas is None else num_replicas
            rank = this_rank if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank {rank} is outside [0, {num_replicas}): pass a rank below num_replicas "
                "(or leave both unset to take them from the process group)"
            )
        size = len(dataset)
        if size == 0:
            raise ValueError("the dataset is empty: DistributedSampler has nothing to shard")
        if drop_last and size < num_replicas:
            raise ValueError(
                f"the dataset has {size} samples, fewer than num_replicas={num_replicas}, so "
                "with drop_last=True every rank would get none: use drop_last=False (pads by "
                "repeating samples) or fewer ranks"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        # Global positions of this epoch's order already consumed before a resume.
        self._skip = 0
        # Where this pass's padding repeats the epoch's order from: 0 (as an uninterrupted pass
        # does), or the position a resume on another number of ranks started at.
        self._pad_origin = 0
        # The current pass: where it started in the global order, its length on this rank,
        # and how many indices it has yielded so far.
        self._pass_skip = 0
        self._pass_len = self.num_samples
        self._yielded = 0
        self._reader: LoaderPosition | None = None  # the DataLoader reading the current pass
        self._passes_this_epoch = 0
        self._complete_this_epoch = False
        self._warned = False
        self._replay_pending = False

    @property
    def num_samples(self) -> int:
        """Length of this rank's shard for the coming (or current) pass."""
        return shard_length(len(self.dataset) - self._skip, self.num_replicas, self.drop_last)

    @property
    def total_size(self) -> int:
        """Length of the global order for the coming pass, padding included."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch, hence the shuffle order; call it on every rank before each epoch.

        Setting the epoch a resumed sampler was loaded at keeps its place in that epoch.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._skip = self._pad_origin = 0
            self._pass_skip, self._pass_len, self._yielded = 0, self.num_samples, 0
            self._reader = None
            self._passes_this_epoch = 0
            self._complete_this_epoch = False
            self._replay_pending = False  # the last pass was a peek before this set_epoch

    def _global_order(self) -> list[int]:
        size = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator).tolist()
        else:
            order = list(range(size))
        rest = order[self._skip:]
        total = self.total_size
        if total <= len(rest):
            return rest[:total]
        if not rest:
            return []
        # Pad by repeating the epoch's order from the pass's pad origin (as many times as a
        # tiny dataset needs): its start for an uninterrupted pass, so a job resumed on the same
        # number of ranks pads with exactly the samples the uninterrupted pass used and stays
        # bitwise equal to it. A pass resumed on another number of ranks pads from where it
        # started instead, so nothing consumed is replayed; the origin is saved with the
        # position, so a later resume of that pass pads as it did.
        source = order[self._pad_origin:]
        missing = total - len(rest)
        return rest + (source * math.ceil(missing / len(source)))[:missing]

    def _warn_if_epoch_repeats(self) -> None:
        # Replayed for real: a full pass of this epoch already ran, or two earlier passes did
        # (an epoch loop that breaks early). Such a pass is only suspect when it starts: a peek
        # (``next(iter(loader))``) right before ``set_epoch``, as in pytorch/examples' DDP
        # tutorial, is one too. It is reported when it runs to its end, or when another pass
        # starts before set_epoch moved on; set_epoch to a new epoch clears it.
        if self._replay_pending:
            self._warn_replayed()
        self._passes_this_epoch += 1
        replayed = self._complete_this_epoch or self._passes_this_epoch >= 3
        self._replay_pending = replayed and self.shuffle and not self._warned

    def _warn_replayed(self) -> None:
        self._replay_pending = False
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"DistributedSampler: a new pass started at epoch {self.epoch}, the same epoch as "
            "the previous pass, so it repeats that pass's shuffled order. Call "
            "sampler.set_epoch(epoch) with the epoch number at the start of every epoch.",
            UserWarning,
            stacklevel=4,
        )

    def __iter__(self) -> Iterator[int]:
        self._warn_if_epoch_repeats()
        order = self._global_order()
        shard = order[self.rank : len(order) : self.num_replicas]
        self._pass_skip, self._pass_len, self._yielded = self._skip, len(shard), 0
        self._reader = None
        return self._count(shard)

    def _count(self, shard: list[int]) -> Iterator[int]:
        for index in shard:
            if not self._yielded:  # the DataLoader reading this pass, if one does
                self._reader = LoaderPosition.of_caller(self)
            self._yielded += 1
            yield index
        # The pass is over: a later iteration of this epoch starts from its beginning.
        self._skip = self._pad_origin = 0
        self._complete_this_epoch = True
        if self._replay_pending:
            self._warn_replayed()

    def consumed(self, samples_per_rank: int | None = None) -> int:
        """How many positions of this epoch's global order the whole job has consumed.

        Args:
            samples_per_rank: samples each rank has actually used in this pass. By default,
                what the ``DataLoader`` reading this sampler has handed to the loop (a loader
                with worker processes reads ahead of it: the samples read ahead are not
                counted), or, with no ``DataLoader`` or one reading through a batch sampler
                other than torch's ``BatchSampler``, what this sampler has yielded.
        """
        used = samples_per_rank
        if used is None:
            finished = self._yielded >= self._pass_len
            used = self._reader.used(self._yielded, finished) if self._reader else self._yielded
        if used >= self._pass_len:
            return len(self.dataset)  # the pass is complete, padding and dropped tail included
        return min(self._pass_skip + used * self.num_replicas, len(self.dataset))

    def state_dict(self, samples_per_rank: int | None = None) -> dict[str, int]:
        """The position to resume from: ``{"epoch", "consumed", "seed", "num_replicas", "pad_origin",
        "dataset_size"}``.

        ``consumed`` counts positions of the job-wide order, so the state is the same on every
        rank and may be loaded by a job with a different number of ranks. ``pad_origin`` is
        where the current pass's padding repeats the order from (0 unless the pass was itself
        resumed on another number of ranks).

        Args:
            samples_per_rank: see :meth:`consumed`.
        """
        return {"epoch": self.epoch, "consumed": self.consumed(samples_per_rank), "seed": self.seed,
                "num_replicas": self.num_replicas, "pad_origin": self._pad_origin,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the epoch and position saved by :meth:`state_dict`.

        The next pass yields only the samples the saved job had not yet consumed, sharded over
        this sampler's ranks; call ``set_epoch(epoch + 1)`` before the pass after it, as usual.

        Raises:
            ValueError: the state is malformed or was saved with another seed or dataset size.
        """
        missing = {"epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}: pass state_dict()'s output")
        if "seed" in state and state["seed"] != self.seed:
            raise ValueError(
                f"sampler state was saved with seed={state['seed']}, this sampler has "
                f"seed={self.seed}: resuming would replay a different order"
            )
        size = state.get("dataset_size")
        if size is not None and int(size) != len(self.dataset):
            raise ValueError(
                f"sampler state was saved for a dataset of {size} samples, this sampler's has "
                f"{len(self.dataset)}: the epoch's order would differ, replaying some samples "
                "and skipping others. Resume with the same dataset, or start the epoch afresh "
                "(set_epoch without load_state_dict)"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= len(self.dataset):
            raise ValueError(
                f"sampler state says {consumed} samples were consumed, but the dataset has "
                f"{len(self.dataset)}: was it saved for another dataset?"
            )
        self.epoch = int(state["epoch"])
        self._skip = consumed
        # Resumed on as many ranks as saved: pad this pass exactly as the uninterrupted one did;
        # on another number, from the resume point, so nothing consumed is replayed.
        if state.get("num_replicas") == self.num_replicas:
            origin = int(state.get("pad_origin", 0))
            if not 0 <= origin <= consumed:
                raise ValueError(
                    f"sampler state has pad_origin={origin}, outside [0, consumed={consumed}]: "
                    "pass state_dict()'s output unchanged"
                )
            self._pad_origin = origin
        else:
            self._pad_origin = consumed
        self._pass_skip, self._pass_len, self._yielded = consumed, self.num_samples, 0
        self._reader = None
        self._passes_this_epoch = 0
        self._complete_this_epoch = False
        self._replay_pending = False
