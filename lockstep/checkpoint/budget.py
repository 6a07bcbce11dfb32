"""Pacing asynchronous saves to a share of the loop's time (``Checkpointer(max_overhead=...)``).

A loop that calls ``save()`` every step checkpoints every step only when a save costs a small
part of a step. When it does not (short steps, a GPU step bound by the Python that launches
it), the next best thing is to save as often as a stated share of the time allows, the way
CheckFreq (Mohan et al., FAST 2021) tunes its checkpoint frequency to a bound on overhead.

What a save costs here is what it takes from training: the training thread's time in
``save()`` plus the writing thread's CPU time (encoding, checksums, writes: on a machine whose
cores the ranks fill, or under the GIL, the loop gives up about that much). Its expected cost
is the median of the last few saves' (the writer's part is known once it has finished; until
then the training thread's part stands for the whole of the newest).

The ranks must skip the same calls, and a call that asks the others costs a meeting and a
collective: too much to pay every step when most calls are skipped. So the pace is set in
steps, not seconds: at each call where the ranks meet, each proposes the first step at which
the next save keeps within the share (the expected cost over the share, divided by the
seconds per step measured since the last such call), and the latest proposal holds on every
rank. Calls before that step return at once, without meeting. When the world changes
(``lockstep.Survivors``), every rank meets at its next call again: a rank that joined knows no
agreed step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

__all__ = ["SaveBudget", "check_share"]

_WINDOW = 5  # saves whose costs are remembered (median): one slow save does not stall the next


def check_share(share: object) -> float:
    """``share`` as a float in (0, 1], or a TypeError/ValueError saying what is wrong."""
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        raise TypeError(
            f"max_overhead must be a number (the share of the loop's time saves may take, e.g. "
            f"0.05 for 5%), got {type(share).__name__} {share!r}"
        )
    if not 0 < share <= 1:
        raise ValueError(
            f"max_overhead must be in (0, 1] (a share of the loop's time, e.g. 0.05 for 5%), "
            f"got {share!r}"
        )
    return float(share)


class SaveBudget:
    """Decides which steps' saves may be passed over so that saves take at most ``share``.

    Args:
        share: the largest share of the time that saves may take, in (0, 1].
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = check_share(share)
        self._clock = clock
        self._costs: deque[float] = deque(maxlen=_WINDOW)  # whole costs of finished saves
        self._newest: tuple[object, float] | None = None  # (token, training-thread seconds)
        self._met: tuple[float, int] | None = None  # (time, step) of the last meeting
        self.next_step: int | None = None  # the first step whose save the ranks meet for

    def forget(self) -> None:
        """Meet at the next call (the pace is measured afresh; the costs are kept): the world
        changed, and a rank that joined it knows no agreed step."""
        self._met, self.next_step = None, None

    def now(self) -> float:
        return self._clock()

    def cost(self) -> float:
        """The expected cost of a save in seconds (0 before any save)."""
        if self._newest is not None and not self._costs:
            return self._newest[1]
        return statistics.median(self._costs) if self._costs else 0.0

    def interval(self) -> float:
        """Seconds between the starts of two saves that keep within the share."""
        return self.cost() / self.share

    def passes_over(self, step: int) -> bool:
        """Whether the save of ``step`` is skipped without meeting the other ranks: it comes
        after the last meeting's step and before the agreed :attr:`next_step`."""
        if self._met is None or self.next_step is None:
            return False
        return self._met[1] < step < self.next_step

    def propose(self, step: int) -> int:
        """At a meeting for ``step``: the first step at which the next save keeps within the
        share, from the expected cost and the seconds per step since the last meeting."""
        now = self.now()
        last, self._met = self._met, (now, step)
        if last is None or step <= last[1] or now <= last[0]:
            return step + 1  # no pace measured yet (or the steps went back): meet again next
        per_step = (now - last[0]) / (step - last[1])
        return step + max(1, math.ceil(self.interval() / per_step - 1e-9))  # 2.0000001 is 2

    def agree(self, proposals: list[int]) -> None:
        """Every rank's proposal, the same on every rank: the latest one holds."""
        self.next_step = max(proposals)

    def taken(self, token: object, seconds: float) -> None:
        """A save took ``seconds`` of the training thread; its writer's part follows through
        :meth:`written` with the same ``token``."""
        self._newest = (token, seconds)

    def written(self, token: object, seconds: float) -> None:
        """The writer of the save made with ``token`` used ``seconds`` of CPU; a token other
        than the newest save's (already counted, or unknown) changes nothing."""
        if self._newest is None or self._newest[0] is not token:
            return
        self._costs.append(self._newest[1] + seconds)
        self._newest = None
