"""Prefetching: start the next unit's all-gather while the current unit computes.

Which unit comes next is learnt, not declared: during the first step every unit's forward and
every unit's backward is recorded in the order it happens (the root first in both: its forward
encloses the blocks', and its outputs are the first to get a gradient). From the second step on,
a unit entering its forward starts the asynchronous all-gather of the unit after it in the
recorded forward order, before its own forward computes; a unit entering its backward does the
same for the unit after it in the recorded backward order. The gather then overlaps with the
computation, and a unit's own unshard only waits for it (Zhao et al., "PyTorch FSDP", 2023,
section 3.3: forward and backward prefetching). A guess that turns out wrong (a unit that does
not run this step) costs only the wasted gather: leftovers are dropped at the end of backward and
at the start of the next forward, before the optimizer could have changed the shards.

:func:`set_prefetch` turns it off (for memory: a prefetch holds one more unit gathered), and
:func:`record_events` lists what the units did, in order, for tests and debugging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from torch import nn

from lockstep.fsdp.registry import get_unit

__all__ = ["EVENTS", "Prefetcher", "record_events", "set_prefetch"]

#: What :func:`record_events` reports, as ``(event, unit name)`` pairs.
EVENTS = (
    "gather-issued",  # an all-gather of the unit's parameters started (prefetched or not)
    "gather-waited",  # the unit waited for its all-gather and holds its full parameters
    "forward-begin",  # the unit's forward computes from here
    "forward-end",  # the unit's forward returned
    "backward-begin",  # the first gradient reached the unit's outputs
    "reduce-issued",  # the unit's gradients went into an asynchronous reduce-scatter
    "reduce-waited",  # the end-of-backward callback waited for that reduce-scatter
)


class _Unit(Protocol):
    prefetch: bool
    listener: Callable[[str, str], None] | None

    def start_gather(self) -> None: ...

    def drop_gather(self) -> None: ...


class Prefetcher:
    """The forward and backward order of the units under one root, and the early gathers."""

    def __init__(self) -> None:
        self.forward_order: list[_Unit] = []
        self.backward_order: list[_Unit] = []
        self.recording = True  # until the first backward ends
        self._issued: list[_Unit] = []

    def on_forward(self, unit: _Unit) -> None:
        """``unit`` holds its parameters and is about to compute: gather the next one."""
        self._step(unit, self.forward_order)

    def on_backward(self, unit: _Unit) -> None:
        """``unit`` holds its parameters for backward: gather the next one backward reaches."""
        self._step(unit, self.backward_order)

    def _step(self, unit: _Unit, order: list[_Unit]) -> None:
        if self.recording:
            if unit not in order:
                order.append(unit)
            return
        if not unit.prefetch or unit not in order:
            return
        index = order.index(unit) + 1
        if index < len(order):
            following = order[index]
            following.start_gather()
            self._issued.append(following)

    def end_backward(self) -> None:
        """The step's backward is over: stop recording, drop gathers nobody used."""
        self.recording = False
        self.drop()

    def drop(self) -> None:
        """Wait for and discard prefetched gathers not yet used (their shards may change)."""
        for unit in self._issued:
            unit.drop_gather()
        self._issued.clear()


def _units(module: nn.Module) -> list[_Unit]:
    units: list[_Unit] = [u for m in module.modules() if (u := get_unit(m)) is not None]
    if not units:
        raise ValueError(f"{type(module).__name__} has no fully sharded module; call lockstep.fully_shard first")
    return units


def set_prefetch(module: nn.Module, enabled: bool) -> None:
    """Turn prefetching of the next unit's all-gather on (the default) or off under ``module``.

    Off saves the memory of one gathered unit and serialises each gather with the computation.
    The results are identical either way.

    Raises:
        ValueError: ``module`` holds no fully sharded unit.
    """
    for unit in _units(module):
        unit.prefetch = bool(enabled)


@contextlib.contextmanager
def record_events(module: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """Collect ``(event, unit name)`` pairs, in the order they happen, of every unit under ``module``.

    The events are listed in :data:`EVENTS`; unit names are module paths under the root (``""``
    for the root). Names are known once the root ran its first forward.

    Example::

        with record_events(model) as events:
            loss_fn(model(x), y).backward()
        # [("gather-waited", ""), ("gather-issued", "blocks.0"), ("forward-begin", ""), ...]
    """
    events: list[tuple[str, str]] = []
    units = _units(module)

    def listen(event: str, name: str) -> None:
        events.append((event, name))

    saved = [u.listener for u in units]
    try:
        for unit in units:
            unit.listener = listen
        yield events
    finally:
        for unit, listener in zip(units, saved):
            unit.listener = listener
