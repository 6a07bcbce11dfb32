"""Cross-rank summaries while training runs: one small asynchronous all-gather every N steps.

Every ``every`` steps each rank contributes its mean seconds per phase over those steps; the
gather is started asynchronously and read ``every`` steps later, when it is long complete, so
no step waits for it. Rank 0 logs who is slowest and why
(:func:`~lockstep.doctor.attribution.straggler_from_means`). A rank that joined early (uneven
inputs, ``join()``) pauses the gathers, which it would otherwise miss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lockstep.doctor.records import PHASES

__all__ = ["RankGather"]

logger = logging.getLogger("lockstep.doctor.recorder")  # the name users configure

KEYS = (*PHASES, "step")


class RankGather:
    """The periodic gather of per-rank phase means over ``group``.

    Args:
        group: the process group (None or a world of one: never gathers).
        device: where the gathered tensor lives under NCCL.
        backend: the group's backend, read when the recorder was built.
        every: steps between gathers (0: never).
        recent: returns the phases of the latest closed steps (``Recorder.step_phases``).
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, backend: str | None,
                 every: int, recent: Callable[[], list[dict[str, float]]]) -> None:
        self.group, self.device, self.backend, self.every = group, device, backend, every
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.paused = False
        self.latest: list[dict[str, float]] = []  # the last cross-rank summary read
        self._recent = recent
        self._gather: tuple[Any, torch.Tensor] | None = None

    def step_closed(self, step_count: int) -> None:
        """Called after each closed step: every ``every`` steps, read the last gather, start one."""
        if not self.every or step_count % self.every:
            return
        if self.group is None or self.world_size == 1 or self.paused:
            return
        if self._gather is not None:
            work, table = self._gather
            work.wait()  # issued `every` steps ago: long complete
            self._log(table.view(self.world_size, -1).tolist(), step_count)
        recent = self._recent()[-self.every:]
        local = torch.tensor([sum(p[k] for p in recent) / max(1, len(recent)) for k in KEYS],
                             dtype=torch.float64)
        if self.backend == "nccl":
            local = local.to(self.device)
        table = torch.empty(self.world_size * len(KEYS), dtype=local.dtype, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(table, local, group=self.group, async_op=True)
        self._gather = (work, table)

    def _log(self, rows: list[list[float]], step_count: int) -> None:
        from lockstep.doctor.attribution import straggler_from_means

        self.latest = [dict(zip(KEYS, row)) for row in rows]
        if self.rank == 0:
            finding = straggler_from_means(self.latest)
            logger.info("lockstep profile, step %d: %s", step_count, finding.sentence())
