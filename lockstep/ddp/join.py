"""Uneven inputs: ranks that run out of batches shadow the others' collectives.

Without this, a rank whose data loader is shorter leaves its peers waiting forever in the next
all-reduce. Inside ``ddp.join()``, every forward of an active rank first all-reduces a two-number
announcement — "I am active", "my backward will synchronise" — so a rank that has finished can
mirror exactly the collectives of that iteration (buffer broadcast, one all-reduce of zeros per
bucket through the same comm hook, the unused-parameter count). When the announcement sums to
zero, every rank has finished; the model of the rank that ran longest is then broadcast so all
replicas end identical.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lockstep import hang
from lockstep.ddp.replica_sync import broadcast_coalesced
from lockstep.progress import GroupProgress

if TYPE_CHECKING:
    from lockstep.ddp.wrapper import DistributedDataParallel

__all__ = ["UnevenInputs"]

logger = logging.getLogger(__name__)


class UnevenInputs:
    """The join protocol of one :class:`DistributedDataParallel` model (see module docstring)."""

    def __init__(
        self,
        ddp: "DistributedDataParallel",
        divide_by_initial_world_size: bool,
        throw_on_early_termination: bool,
    ) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.iterations = 0
        self.progress = GroupProgress(ddp.process_group)  # names a rank that never arrives

    def _exchange(self, active: bool, sync: bool) -> tuple[int, int, int | None]:
        """All-reduce who is active and whether backward syncs.

        Returns:
            (number of active ranks, number that will sync, global rank of the lowest active
            group rank — the source of buffers while rank 0 may have joined — or None).
        """
        world = self.ddp.world_size
        flags = torch.zeros(world + 1, dtype=torch.int32, device=self.ddp._device)
        flags[0] = int(sync)
        flags[1 + dist.get_rank(self.ddp.process_group)] = int(active)
        hang.run(self.progress, "DDP join announcement",
                 lambda: dist.all_reduce(flags, group=self.ddp.process_group))
        active_ranks = flags[1:].nonzero().flatten().tolist()
        src = dist.get_global_rank(self.ddp.process_group, active_ranks[0]) if active_ranks else None
        return len(active_ranks), int(flags[0]), src

    def announce(self, sync_backward: bool) -> int:
        """Active rank, before each forward: tell joined ranks what this iteration does.

        Returns:
            The global rank whose buffers this iteration broadcasts (an active one).
        """
        active, _, src = self._exchange(True, sync_backward)
        world = self.ddp.world_size
        if active < world and self.throw_on_early_termination:
            raise RuntimeError(
                f"DistributedDataParallel.join: rank {dist.get_rank()} still has inputs but "
                f"{world - active} rank(s) ran out (throw_on_early_termination=True). Give every "
                "rank the same number of batches, e.g. DistributedSampler(drop_last=True)."
            )
        if self.ddp._reducer is not None:
            divisor = world if self.divide_by_initial_world_size else active
            self.ddp._reducer.grad_scale = world / divisor
        self.iterations += 1
        return src

    def shadow_until_all_joined(self) -> None:
        """Joined rank: mirror the active ranks' collectives until every rank has joined."""
        reducer = self.ddp._reducer
        while True:
            active, sync, src = self._exchange(False, False)
            if active == 0:
                break
            if self.throw_on_early_termination:
                raise RuntimeError(
                    f"DistributedDataParallel.join: rank {dist.get_rank()} ran out of inputs "
                    f"while {active} rank(s) still have some (throw_on_early_termination=True)."
                )
            self.ddp._sync_buffers(src)
            if sync and reducer is not None:
                reducer.shadow_backward()
        self._sync_final_model()

    def _sync_final_model(self) -> None:
        """Broadcast the model of the rank that ran the most iterations (ties: lowest rank)."""
        group, world = self.ddp.process_group, self.ddp.world_size
        rank = dist.get_rank(group)
        key = torch.tensor([self.iterations * world + (world - 1 - rank)], dtype=torch.int64,
                           device=self.ddp._device)
        hang.run(self.progress, "DDP join: who ran longest",
                 lambda: dist.all_reduce(key, op=dist.ReduceOp.MAX, group=group))
        src_group_rank = world - 1 - int(key) % world
        src = dist.get_global_rank(group, src_group_rank)
        module = self.ddp.module
        state = [p.data for p in module.parameters()] + list(module.buffers())
        hang.run(self.progress, "DDP join: final model broadcast",
                 lambda: broadcast_coalesced(state, src, group))
        logger.debug("join: final model taken from rank %d", src)
