"""VirtualShardSampler: batches made of fixed virtual shards, the same at any world size.

For epoch ``e`` the global order is a permutation of the dataset from ``seed + e`` (or
``0..n-1`` unshuffled), cut into global batches of ``virtual_shards * shard_size`` samples (an
incomplete tail is dropped). Global batch ``b``'s virtual shard ``s`` is its samples
``s*shard_size .. (s+1)*shard_size - 1``; rank ``r`` of ``N`` yields, for each step, the
concatenation of its ``V/N`` consecutive shards ``r*V/N ..``. Nothing depends on ``N`` but which
rank reads which shard, so a job saved on ``N`` ranks resumes on ``M`` at the same sample.

Use it as a ``DataLoader``'s ``batch_sampler`` and split each batch with
:func:`lockstep.ddp.virtual_shards.split_shards`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from lockstep.loader_position import LoaderPosition
from lockstep.sampler import world_from_context
from lockstep.virtual_world import check_virtual_shards, resolve_virtual_shards

__all__ = ["VirtualShardSampler"]


class VirtualShardSampler(Sampler[list[int]]):
    """Yield, per step, this rank's virtual shards of the global batch (a batch sampler).

    Args:
        dataset: anything with ``len()``.
        virtual_shards: ``V``, a power of two that the world size divides; ``None``: the ``V`` of
            ``lockstep run --virtual-shards V``.
        shard_size: samples per virtual shard (the global batch is ``V * shard_size``).
        num_replicas, rank: the world; by default from the default group or the launcher.
        shuffle: permute the dataset each epoch (from ``seed + epoch``).
        seed: the permutation's seed.

    Raises:
        ValueError: ``num_replicas`` does not divide ``virtual_shards``, or the dataset holds
            less than one global batch.
    """

    def __init__(
        self,
        dataset: Sized,
        virtual_shards: int | None,
        shard_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if num_replicas is None or rank is None:
            world, me = world_from_context()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        virtual_shards = resolve_virtual_shards(virtual_shards)
        self.shards_per_rank = check_virtual_shards(virtual_shards, num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside a world of {num_replicas} ranks")
        if not isinstance(shard_size, int) or isinstance(shard_size, bool):
            raise TypeError(f"shard_size must be an int (samples per virtual shard), got {shard_size!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be a positive number of samples, got {shard_size}")
        self.dataset, self.virtual_shards, self.shard_size = dataset, virtual_shards, shard_size
        self.num_replicas, self.rank, self.shuffle, self.seed = num_replicas, rank, shuffle, seed
        self.global_batch = virtual_shards * shard_size
        if len(dataset) < self.global_batch:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch of "
                f"{virtual_shards} virtual shards x {shard_size}: lower shard_size"
            )
        self.epoch = 0
        self._skip = 0  # steps of this epoch already done before a resume: the next pass skips them
        self._pass_skip = 0  # what the current (or last) pass skipped, for state_dict
        self._yielded = 0
        self._reader: LoaderPosition | None = None  # the DataLoader reading the current pass

    def __len__(self) -> int:
        return len(self.dataset) // self.global_batch - self._skip

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; a resumed position applies to its own epoch only."""
        if epoch != self.epoch:
            self._skip = self._pass_skip = self._yielded = 0  # a save now is at the top of the new epoch
            self._reader = None
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
        mine = self.shard_size * self.shards_per_rank
        begin = self.rank * mine
        skip, self._yielded, self._reader = self._skip, 0, None
        self._pass_skip = skip
        for step in range(skip, n // self.global_batch):
            batch = order[step * self.global_batch : (step + 1) * self.global_batch]
            if not self._yielded:  # the DataLoader reading this pass, if one does
                self._reader = LoaderPosition.of_caller(self)
            self._yielded += 1
            yield batch[begin : begin + mine].tolist()
        self._skip = 0  # a pass after this one is a whole epoch; state_dict still counts this one

    def state_dict(self, steps: int | None = None) -> dict[str, int]:
        """``{"epoch", "steps", "virtual_shards", "shard_size", "seed"}``, the same on every rank.

        Args:
            steps: steps of this epoch the loop has used since the pass began. By default,
                the batches the ``DataLoader`` reading this sampler has handed to the loop (one
                with worker processes reads ahead of it: those read ahead are not counted), or,
                read without a ``DataLoader``, the batches yielded.
        """
        if steps is None:
            steps = self._reader.used(self._yielded, False) if self._reader else self._yielded
        done = self._pass_skip + steps
        return {"epoch": self.epoch, "steps": done, "virtual_shards": self.virtual_shards,
                "shard_size": self.shard_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and step, on any world size that divides ``V``.

        Raises:
            ValueError: the state was saved with another ``virtual_shards``, ``shard_size``,
                ``seed`` or ``shuffle`` (a different run; states saved before ``shuffle`` was
                in them are not checked for it), lacks its epoch or steps, or has done more
                steps than an epoch of this dataset holds (another dataset).
        """
        missing = {"epoch", "steps"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}: pass state_dict()'s output")
        for key in ("virtual_shards", "shard_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's sampler has {key}={state[key]}, this one "
                    f"{key}={getattr(self, key)}: the same run needs the same {key}"
                )
        steps, per_epoch = int(state["steps"]), len(self.dataset) // self.global_batch
        if not 0 <= steps <= per_epoch:
            raise ValueError(
                f"sampler state says {steps} steps of epoch {state['epoch']} were done, but an "
                f"epoch of this dataset ({len(self.dataset)} samples, global batches of "
                f"{self.global_batch}) has {per_epoch}: resume with the dataset it was saved with"
            )
        self.epoch, self._skip, self._yielded = int(state["epoch"]), steps, 0
        self._reader = None
        self._pass_skip = self._skip
