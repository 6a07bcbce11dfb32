"""A DataLoader over this rank's shard: the right sampler, per-rank seeds, batches on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from lockstep.sampler import DistributedSampler
from lockstep.tensors import move_to

__all__ = ["ShardedLoader", "move_to_device", "seed_worker"]


def seed_worker(worker_id: int) -> None:
    """Seed NumPy in a DataLoader worker from the seed torch gave it.

    torch seeds each worker's torch and ``random`` generators from the loader's generator, but
    not NumPy's, so without this every worker (and every rank) draws the same NumPy numbers.
    """
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(torch.initial_seed() % 2**32)


def _chain(first: Callable[[int], None], second: Callable[[int], None] | None) -> Callable:
    if second is None:
        return first
    return _Chained(first, second)


class _Chained:
    """Two worker_init_fn's in a row; a class rather than a closure, so it pickles."""

    def __init__(self, first: Callable[[int], None], second: Callable[[int], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        self.second(worker_id)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a batch (nested in tuples, lists, dicts, namedtuples, dataclasses) to ``device``.

    :func:`lockstep.tensors.move_to`, the walk DataParallel and DDP use too; kept under this
    name for existing callers.
    """
    return move_to(batch, device)


class ShardedLoader:
    """Iterate this rank's batches of ``dataset``, moved to ``device``.

    Wraps a ``DataLoader`` whose sampler is a :class:`lockstep.DistributedSampler`; it counts
    the batches the loop has really received, so :meth:`state_dict` is exact even when worker
    processes read ahead.

    Args:
        dataset: the dataset, indexable and with ``len()``.
        batch_size: samples per batch on this rank.
        rank: this rank; ``world_size``: the number of ranks.
        device: where batches go; ``None`` leaves them where the loader made them.
        shuffle: shuffle each epoch (call :meth:`set_epoch`).
        seed: the shuffle's seed, also the base of per-rank worker seeds.
        drop_last: drop the uneven tail of the dataset and the last partial batch.
        **loader_kwargs: anything else for ``DataLoader`` (``num_workers``, ``collate_fn``...).
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        if "sampler" in loader_kwargs or "batch_sampler" in loader_kwargs:
            raise ValueError(
                "ShardedLoader chooses the sampler itself: drop sampler=/batch_sampler=, or build "
                "your own DataLoader around lockstep.DistributedSampler"
            )
        self.sampler = DistributedSampler(dataset, world_size, rank, shuffle, seed, drop_last)
        self.device = device
        self.batch_size = batch_size
        # Distinct, reproducible worker seeds per rank: torch derives them from this generator.
        generator = torch.Generator()
        generator.manual_seed(seed * 100_003 + rank)
        loader_kwargs.setdefault("generator", generator)
        loader_kwargs["worker_init_fn"] = _chain(seed_worker, loader_kwargs.get("worker_init_fn"))
        if device is not None and device.type == "cuda":
            loader_kwargs.setdefault("pin_memory", True)
        self.loader: DataLoader[Any] = DataLoader(
            cast("Dataset[Any]", dataset), batch_size=batch_size, sampler=self.sampler, drop_last=drop_last, **loader_kwargs
        )
        self._batches = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._batches = 0
        for batch in self.loader:
            self._batches += 1
            yield batch if self.device is None else move_to_device(batch, self.device)

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch's shuffle order; call it before each epoch, on every rank."""
        self.sampler.set_epoch(epoch)
        self._batches = 0

    def state_dict(self) -> dict[str, int]:
        """Where to resume: the sampler's state counting only batches the loop received."""
        return self.sampler.state_dict(samples_per_rank=self._batches * self.batch_size)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a :meth:`state_dict`, possibly saved by a job with another world size."""
        self.sampler.load_state_dict(state)
        self._batches = 0
