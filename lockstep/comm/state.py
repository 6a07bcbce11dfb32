"""What every lockstep hook carries: the process group to reduce over and a byte counter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lockstep.distributed import resolve_group

__all__ = ["ByteCounter", "CommState", "resolve_state"]


@dataclass
class ByteCounter:
    """Bytes this rank hands to collectives, and the training steps they were spent on.

    ``bytes_sent`` counts the payload of each collective call on this rank (the size of the
    tensor all-reduced), not the wire traffic of a particular algorithm: a ring all-reduce moves
    about ``2 (N - 1) / N`` times that, whatever the hook, so ratios between hooks hold.

    Example::

        counter = ByteCounter()
        counter.record(torch.ones(4))
        counter.end_step()
        assert counter.bytes_per_step() == 16
    """

    bytes_sent: int = 0
    steps: int = 0

    def record(self, *tensors: Any) -> None:
        """Add the size of each tensor about to be sent."""
        for tensor in tensors:
            self.bytes_sent += tensor.numel() * tensor.element_size()

    def end_step(self) -> None:
        """Mark the end of one training step (hooks call this on the last bucket)."""
        self.steps += 1

    def bytes_per_step(self) -> float:
        """Mean bytes sent per finished step (0.0 before the first)."""
        return self.bytes_sent / self.steps if self.steps else 0.0

    def reset(self) -> None:
        """Start counting again, e.g. after warm-up steps."""
        self.bytes_sent = 0
        self.steps = 0


@dataclass
class CommState:
    """State for the stateless hooks (plain, fp16, bf16): the group and a byte counter.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
        counter: where the bytes sent are added up.

    Example::

        state = CommState()
        ddp.register_comm_hook(state, fp16_compress_hook)
        ...
        print(state.counter.bytes_per_step())
    """

    process_group: dist.ProcessGroup | None = None
    counter: ByteCounter = field(default_factory=ByteCounter)


def resolve_state(state: Any) -> tuple[dist.ProcessGroup, ByteCounter | None]:
    """The group and counter of a hook state: a :class:`CommState`-like object, a group or None.

    Accepting a bare group (or ``None``) keeps the hooks usable exactly as torch's are, with
    ``register_comm_hook(process_group, hook)``; the bytes are then not counted.
    """
    if state is None or isinstance(state, dist.ProcessGroup):
        group, counter = state, None
    elif hasattr(state, "process_group"):
        group, counter = state.process_group, getattr(state, "counter", None)
    else:
        raise TypeError(
            f"hook state must be None, a ProcessGroup or a CommState, got {type(state).__name__}"
        )
    return resolve_group(group), counter
