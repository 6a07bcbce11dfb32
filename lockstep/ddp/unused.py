"""Which parameters take part in a backward: the unused-parameter search and the static graph.

With ``find_unused_parameters`` a parameter counts as used when it got a gradient since the last
synchronised backward (``no_sync()`` backwards included: their accumulated gradient is reduced
too). At the end of each synchronised backward one small all-reduce counts, per parameter, the
ranks that used it; a parameter no rank used keeps its ``.grad`` as it was.

With ``static_graph=True`` the graph is the same every iteration, so the first backward is the
record: how many times each gradient arrives (twice for a block checkpointed twice), which
parameters this rank never reached, and which no rank reached. There is no search afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.diagnose import hang
from lockstep.diagnose.progress import GroupProgress

__all__ = ["ParameterUsage"]


class ParameterUsage:
    """Per parameter: used since the last synchronised backward, and the static graph's record.

    Args:
        params: trainable parameters, in registration order.
        group: the process group to count over.
        progress: the group's progress, to name a peer that never joins the count.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup, progress: GroupProgress
    ) -> None:
        self._params = list(params)
        self._group = group
        self._progress = progress
        n = len(self._params)
        # Gradient arrivals per parameter in one backward (static graph: counted in the first).
        self.expected = [1] * n
        self.static_unused: list[int] = []  # static graph: never reached on this rank
        self.static_global_unused: set[int] = set()  # static graph: reached on no rank
        # find_unused: parameters given a gradient since the last synchronised backward.
        self._used = [False] * n

    def mark_used(self, i: int) -> None:
        """Parameter ``i`` got a gradient (in a synchronised or a ``no_sync()`` backward)."""
        self._used[i] = True

    def record_static_graph(self, arrivals: list[int], unreached: list[int]) -> None:
        """The first backward of a static graph: arrivals per parameter, and who was not reached."""
        self.expected = list(arrivals)
        self.static_unused = unreached
        self.static_global_unused = self.globally_unused(unreached)

    def missing(self, unready: list[int]) -> list[int]:
        """Of ``unready``, those the static graph expects a gradient for."""
        return [i for i in unready if self.expected[i] > 0]

    def take_globally_unused(self) -> set[int]:
        """Parameters no rank used since the last call (every rank takes part); flags reset."""
        unused = self.globally_unused([i for i, u in enumerate(self._used) if not u])
        self._used = [False] * len(self._params)
        return unused

    def globally_unused(self, locally_unused: list[int]) -> set[int]:
        """Parameters no rank used; one small all-reduce."""
        used = torch.ones(len(self._params), dtype=torch.int32, device=self._params[0].device)
        used[locally_unused] = 0
        hang.run(self._progress, "DDP unused-parameter count",
                 lambda: dist.all_reduce(used, group=self._group))
        return {i for i, count in enumerate(used.tolist()) if count == 0}
