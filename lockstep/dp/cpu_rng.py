"""Random numbers for replicas that share the CPU: one generator state per replica, reproducibly.

On CUDA every device has its own generator, so replicas on different GPUs draw different random
numbers (dropout masks) while replica 0 continues the caller's stream. On a CPU device list all
replicas would share torch's one CPU generator, drawing from it in whatever order the threads
happen to run: masks then depend on thread timing, and a run cannot be repeated. Instead:

* replica 0 draws from the caller's generator state, exactly as the module alone would;
* replica ``k > 0`` draws from its own state, seeded from a hash of the caller's state and ``k``
  (the caller's generator is read, not advanced, to derive it);
* replicas take turns on the CPU generator (one runs at a time, each in its own thread), so
  each sees only its own state; afterwards the CPU generator is where replica 0 left it.

So the same seed gives the same result on every run, no two replicas share a mask, and the
caller's stream advances exactly as if replica 0's chunk had run alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

import torch

__all__ = ["ReplicaGenerators"]


class ReplicaGenerators:
    """The CPU generator states of ``n`` replicas of one forward; see the module docstring.

    Example:
        >>> rng = ReplicaGenerators(2)
        >>> with rng.turn(1):
        ...     mask = torch.rand(3) > 0.5  # drawn from replica 1's own state
        >>> rng.finish()  # the CPU generator continues from replica 0's state
    """

    def __init__(self, n: int) -> None:
        self._generator = torch.default_generator
        start = self._generator.get_state()
        self._states = [start] + [_derived_state(start, k) for k in range(1, n)]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def turn(self, replica: int) -> Iterator[None]:
        """Run the body alone on the CPU generator, with replica ``replica``'s state."""
        with self._lock:
            self._generator.set_state(self._states[replica])
            try:
                yield
            finally:
                self._states[replica] = self._generator.get_state()

    def finish(self) -> None:
        """Leave the CPU generator where replica 0's draws left it."""
        self._generator.set_state(self._states[0])


def _derived_state(start: torch.Tensor, replica: int) -> torch.Tensor:
    digest = hashlib.blake2b(start.numpy().tobytes(), digest_size=8, key=replica.to_bytes(8, "little"))
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest.digest(), "little"))
    return generator.get_state()
