"""Random numbers for replicas that share the CPU: they draw in replica order, as one process would.

On CUDA every device has its own generator, so replicas on different GPUs draw independently.
On a CPU device list every replica shares torch's one CPU generator; run at the same time, the
replicas would take numbers from it in whatever order their threads happen to reach it, so
dropout masks would depend on thread timing and a run could not be repeated.

Instead, CPU replicas take turns in replica order (each still in its own thread, with the
caller's grad mode and autocast): replica 0 draws from the caller's generator exactly as the
module alone would, replica 1 continues where replica 0 stopped, and so on; afterwards the
generator stands where a single process running the chunks in order leaves it. So a run is
reproducible from its seed, no two replicas share a mask, and the result is bit for bit what
the module computes when called on each chunk in turn, dropout masks included. (It is not the
module run once on the whole batch: that draws layer by layer for every sample, replicas draw
chunk by chunk; with a single random operation whose draws follow the element order, such as
one dropout on the CPU, the two coincide.)

DataParallel takes turns while its model is in training mode, where dropout draws; an eval-mode
forward keeps the replicas running at the same time, one core each, which is what makes CPU
inference faster than the bare module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["TakeTurns"]


class TakeTurns:
    """Let replica threads run their bodies one at a time, in replica order ``0, 1, 2, ...``.

    A replica whose body raises still hands the turn on, so the others never wait forever.

    Example:
        >>> turns = TakeTurns()
        >>> with turns.turn(0):
        ...     pass  # replica 1's ``turn(1)`` waits until this block is left
    """

    def __init__(self) -> None:
        self._next = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def turn(self, replica: int) -> Iterator[None]:
        """Wait until every replica before ``replica`` is done, run the body, pass the turn on."""
        with self._changed:
            self._changed.wait_for(lambda: self._next == replica)
        try:
            yield
        finally:
            with self._changed:
                self._next = replica + 1
                self._changed.notify_all()
