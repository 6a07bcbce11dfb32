"""Uneven inputs: ranks that run out of batches shadow the others' collectives.

Without this, a rank whose data loader is shorter leaves its peers waiting forever in the next
all-reduce. While joining is on, every forward of an active rank first all-reduces a small
announcement — "I am active", "my backward will synchronise", "I broadcast buffers" — so a rank
that has finished can mirror exactly the collectives of that iteration (buffer broadcast, one
all-reduce of zeros per bucket through the same comm hook, the unused-parameter count). When
every rank has finished, the model of the rank that ran longest is broadcast so all replicas end
identical.

Two doors lead here: lockstep's ``ddp.join()``, and torch's generic
``torch.distributed.algorithms.Join([ddp, ...])`` through :meth:`join_hook` (torch's
``Joinable`` interface); both drive the same :class:`UnevenInputs`. The model is reached only
through the small public seam in :class:`JoinableModel`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from lockstep.ddp.replica_sync import broadcast_coalesced
from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress
from lockstep.distributed import global_rank

__all__ = ["DDPJoinHook", "JoinableModel", "UnevenInputs"]

logger = logging.getLogger(__name__)


class JoinableModel(Protocol):
    """What joining needs from a data-parallel model (lockstep's DDP provides it)."""

    module: torch.nn.Module

    @property
    def join_device(self) -> torch.device: ...

    @property
    def join_process_group(self) -> dist.ProcessGroup: ...

    def will_sync_module_buffers(self) -> bool: ...

    def sync_module_buffers(self, src: int) -> None: ...

    def set_gradient_scale(self, scale: float) -> None: ...

    def shadow_backward(self) -> None: ...


class UnevenInputs:
    """The join protocol of one model (see module docstring).

    Args:
        model: the model whose collectives are shadowed.
        divide_by_initial_world_size: average over all ranks (True) or the active ones.
        throw_on_early_termination: raise (lockstep's own ``join()``) instead of shadowing.
    """

    def __init__(
        self,
        model: JoinableModel,
        divide_by_initial_world_size: bool,
        throw_on_early_termination: bool,
    ) -> None:
        self.model = model
        self.group = model.join_process_group
        self.world = dist.get_world_size(self.group)
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.iterations = 0
        self.progress = GroupProgress(self.group)  # names a rank that never arrives

    def _exchange(self, active: bool, sync: bool, buffers: bool) -> tuple[int, int, bool, int | None]:
        """All-reduce who is active, whether backward syncs and whether buffers are broadcast.

        Returns:
            (number of active ranks, number that will sync, whether buffers are broadcast,
            global rank of the highest active group rank — the source of buffers while ranks
            may have joined, as torch's DDP takes it — or None).
        """
        flags = torch.zeros(self.world + 2, dtype=torch.int32, device=self.model.join_device)
        flags[0], flags[1] = int(sync), int(buffers)
        flags[2 + dist.get_rank(self.group)] = int(active)
        hang.run(self.progress, "DDP join announcement",
                 lambda: dist.all_reduce(flags, group=self.group))
        active_ranks = flags[2:].nonzero().flatten().tolist()
        src = global_rank(self.group, active_ranks[-1]) if active_ranks else None
        return len(active_ranks), int(flags[0]), bool(flags[1]), src

    def announce(self, sync_backward: bool) -> int:
        """Active rank, before each forward: tell joined ranks what this iteration does.

        Returns:
            The global rank whose buffers this iteration broadcasts (an active one).
        """
        buffers = self.model.will_sync_module_buffers()
        active, _, _, src = self._exchange(True, sync_backward, buffers)
        if active < self.world and self.throw_on_early_termination:
            raise RuntimeError(
                f"DistributedDataParallel.join: rank {dist.get_rank()} still has inputs but "
                f"{self.world - active} rank(s) ran out (throw_on_early_termination=True). Give "
                "every rank the same number of batches, e.g. DistributedSampler(drop_last=True)."
            )
        divisor = self.world if self.divide_by_initial_world_size else active
        self.model.set_gradient_scale(self.world / divisor)
        self.iterations += 1
        assert src is not None  # this rank is active
        return src

    def shadow_once(self) -> bool:
        """Joined rank: mirror one iteration of the active ranks; False once all have joined."""
        active, sync, buffers, src = self._exchange(False, False, False)
        if active == 0:
            return False
        if self.throw_on_early_termination:
            raise RuntimeError(
                f"DistributedDataParallel.join: rank {dist.get_rank()} ran out of inputs "
                f"while {active} rank(s) still have some (throw_on_early_termination=True)."
            )
        if buffers and src is not None:
            self.model.sync_module_buffers(src)
        if sync:
            self.model.shadow_backward()
        return True

    def shadow_until_all_joined(self) -> None:
        """Joined rank: mirror the active ranks' collectives until every rank has joined."""
        while self.shadow_once():
            pass
        self.finish()

    def finish(self) -> None:
        """Every rank has joined: all take the model of the rank that ran longest."""
        self.model.set_gradient_scale(1.0)
        self._sync_final_model()

    def _sync_final_model(self) -> None:
        """Broadcast the model of the rank that ran the most iterations (ties: the highest rank,
        as torch's DDP picks among its last joiners)."""
        group, world = self.group, self.world
        rank = dist.get_rank(group)
        key = torch.tensor([self.iterations * world + rank], dtype=torch.int64,
                           device=self.model.join_device)
        hang.run(self.progress, "DDP join: who ran longest",
                 lambda: dist.all_reduce(key, op=dist.ReduceOp.MAX, group=group))
        src_group_rank = int(key) % world
        src = global_rank(group, src_group_rank)
        module = self.model.module
        state = [p.data for p in module.parameters()] + list(module.buffers())
        hang.run(self.progress, "DDP join: final model broadcast",
                 lambda: broadcast_coalesced(state, src, group))
        logger.debug("join: final model taken from rank %d", src)


class DDPJoinHook(JoinHook):
    """torch's ``JoinHook`` for lockstep's DDP: what ``torch.distributed.algorithms.Join`` runs.

    ``main_hook`` mirrors one iteration of the active ranks; ``post_hook`` makes every replica
    equal once all have joined. Early termination is torch's ``Join`` to raise, not this hook.
    """

    def __init__(self, state: UnevenInputs, on_done: Callable[[], None] | None = None) -> None:
        self.state = state
        self.on_done = on_done

    def main_hook(self) -> None:
        self.state.shadow_once()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            self.state.finish()
        finally:
            if self.on_done is not None:
                self.on_done()
