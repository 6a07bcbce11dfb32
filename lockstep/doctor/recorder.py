"""The per-rank profiler: marks from the DDP wrapper, its reducer and the optimizer, per step.

Cheap enough to leave on: a handful of clock reads per step, one more per bucket, and one
callback on each all-reduce's future. Nothing synchronises a device (see ``stamps.py``) and
nothing is gathered across ranks except, every ``gather_every`` steps, one small asynchronous
all-gather of per-rank means whose result is read ``gather_every`` steps later.

The optimizer step is found without user code (:mod:`~lockstep.doctor.optimizer_watch`); the
cross-rank summaries are :mod:`~lockstep.doctor.rank_gather`'s and the per-rank file
:mod:`~lockstep.doctor.rank_file`'s. This module holds the marks and the steps they make.

It implements DDP's :class:`~lockstep.ddp.observer.StepObserver`; DDP builds it through
:mod:`lockstep.profilers` (where ``lockstep/__init__.py`` registers it), never by name.
"""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lockstep.doctor.optimizer_watch import OptimizerWatch
from lockstep.doctor.rank_file import RankFile
from lockstep.doctor.rank_gather import RankGather
from lockstep.doctor.records import BucketEvents, StepRecord, phases_of
from lockstep.doctor.stamps import Stamp, Stamps
from lockstep.profilers import StepTiming
from lockstep.tensors import batch_size

__all__ = ["Recorder"]

# Backwards one step may hold while an optimizer that exists has not stepped yet; past this the
# optimizer is taken to be unused and each backward ends a step (a script updating by hand).
_MAX_WAITING_BACKWARDS = 1024

Layout = Callable[[], list[dict[str, Any]]]


class Recorder:
    """Records every step of one model on this rank.

    Args:
        device: the model's device (CUDA events are used on CUDA).
        params: the model's parameters, to recognise its optimizer.
        group: the process group (None: no cross-rank gathers).
        layout: returns the current bucket layout ``[{"index", "bytes", "params"}]``.
        model_info: the ``model`` entry of the profile format.
        out_dir: write ``rank<R>.json`` here at exit (and when ``max_steps`` is reached).
        max_steps: after this many steps, save and end the process (``lockstep doctor``).
        warmup: first steps left out of summaries (bucket rebuild, allocator, caches).
        gather_every: steps between cross-rank summaries logged on rank 0 (0: never).
        history: most recent steps kept (older ones are dropped; summaries use what is kept).
        steps_done: steps the model already took before recording began (they count towards
            ``warmup`` and ``max_steps``: a model found at its first optimizer step).
    """

    def __init__(
        self,
        device: torch.device,
        params: Iterable[torch.Tensor] = (),
        group: dist.ProcessGroup | None = None,
        layout: Layout | None = None,
        model_info: dict[str, Any] | None = None,
        out_dir: str | os.PathLike | None = None,
        max_steps: int | None = None,
        warmup: int = 5,
        gather_every: int = 0,
        history: int = 2000,
        steps_done: int = 0,
    ) -> None:
        if warmup < 0 or gather_every < 0 or history < 1 or (max_steps is not None and max_steps < 1):
            raise ValueError(
                f"Recorder: warmup={warmup}, gather_every={gather_every}, history={history}, "
                f"max_steps={max_steps}: need warmup >= 0, gather_every >= 0, history >= 1, "
                "max_steps >= 1 or None"
            )
        self.device = device
        self.stamps = Stamps(device)
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        # read now: at exit the script may have destroyed the group (torch DDP scripts do)
        self.backend = str(dist.get_backend(group)) if group is not None else None
        self.layout = layout or (list)
        self.model_info = model_info or {}
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.max_steps, self.warmup, self.gather_every = max_steps, warmup, gather_every
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.step_count = steps_done
        self.batch_size: int | None = None
        self._step_samples: collections.Counter[int] = collections.Counter()
        self._counted = False  # a forward's samples were counted since the last backward
        self._pending: list[StepRecord] = []  # closed steps whose CUDA events are not resolved
        self._iterations: collections.deque[tuple[Stamp, Stamp, Stamp, Stamp, Stamp]] = (
            collections.deque(maxlen=history))
        self._cur = StepRecord(begin=time.perf_counter())
        self._fwd: list[Any] = []
        self._bwd: list[Any] | None = None
        self._bucket_events: dict[int, BucketEvents] = {}
        self._optimizer_seen = False
        self._optimizer_awaited: bool | None = None  # an optimizer exists that has not stepped
        self._provisional = 0  # steps ended at a backward, before any optimizer step was seen
        self._closed = steps_done  # steps closed, merged ones too (the cross-rank gathers' clock)
        self._opt_start: Stamp | None = None
        self._gathers = RankGather(group, device, self.backend, gather_every,
                                   lambda: self.step_phases(wait=False))
        self._file = (RankFile(self.out_dir, self.rank, self.payload, lambda: self.step_count)
                      if self.out_dir is not None else None)
        self._optimizers: OptimizerWatch | None = OptimizerWatch(params, self._optimizer_started,
                                                                 self._optimizer_ended)

    @property
    def gathers_paused(self) -> bool:
        """Whether the periodic cross-rank gathers are paused (a rank that joined early)."""
        return self._gathers.paused

    @gathers_paused.setter
    def gathers_paused(self, paused: bool) -> None:
        self._gathers.paused = paused

    @property
    def latest_ranks(self) -> list[dict[str, float]]:
        """The last cross-rank summary read: mean seconds per phase, one dict per rank."""
        return self._gathers.latest

    # ---- forward and backward (called by the DDP wrapper and its reducer) ----------------
    def forward_started(self, inputs: Any = None) -> None:
        now = self.stamps.now()
        if self._cur.synced and not self._optimizer_seen and not self._awaiting_optimizer():
            # No optimizer of this model: the step ended with its last backward.
            self._close(self._cur.backwards[-1][2])
            self._provisional += 1
        if inputs is not None and not self._counted:
            # The first forward before each backward brings new samples (no_sync() micro-
            # batches); a second one before the same backward sees the same samples again
            # (two views of a batch, a contrastive loss).
            found = batch_size(inputs)
            if found is not None:
                self._cur.samples += found
                self._counted = True
                if self.batch_size is None:  # until a step closes: its first micro-batch
                    self.batch_size = found
        self._fwd = [now, now, now]
        self._cur.forwards.append(self._fwd)
        self._bwd = None

    def _awaiting_optimizer(self) -> bool:
        """Whether the step goes on until an optimizer of this model that exists steps.

        Before the first optimizer step a synced backward may be one of several accumulated
        without ``no_sync()``: if an optimizer holding the model's parameters exists, the step
        ends at its step, not at each backward (asked once; see ``OptimizerWatch.present``).
        """
        if self._optimizer_awaited is None:
            self._optimizer_awaited = self._optimizers is not None and self._optimizers.present()
        if self._optimizer_awaited and len(self._cur.backwards) >= _MAX_WAITING_BACKWARDS:
            self._optimizer_awaited = False  # it exists but never steps: a step per backward
        return self._optimizer_awaited

    def forward_synced(self) -> None:
        """The forward's collectives (buffer broadcast) are done; the module runs next."""
        if self._fwd:
            self._fwd[1] = self.stamps.now()

    def forward_ended(self) -> None:
        self._fwd[2] = self.stamps.now()

    def backward_started(self) -> None:
        if self._bwd is None:
            now = self.stamps.now()
            self._bwd = [now, None, None]
            self._bucket_events = {}

    def backward_compute_ended(self) -> None:
        """The last gradient of this backward has been computed (the reduction's wait follows)."""
        if self._bwd is not None and self._bwd[1] is None:
            self._bwd[1] = self.stamps.now()

    def add_exposed(self, seconds: float) -> None:
        """Kept for the reducer's older call; exposed time is measured from the marks."""

    def backward_ended(self, synced: bool = True) -> None:
        """Backward (and, if ``synced``, the gradient reduction) finished."""
        if self._bwd is None:
            self.backward_started()
        bwd = self._bwd
        assert bwd is not None
        bwd[2] = self.stamps.now()
        if bwd[1] is None:
            bwd[1] = bwd[2]
        self._cur.backwards.append(bwd)
        self._cur.buckets.extend(self._bucket_events[i] for i in sorted(self._bucket_events))
        self._bucket_events = {}
        fwd = self._fwd or [bwd[0]] * 3  # no forward marked (a forward outside the wrapper)
        self._iterations.append((fwd[0], fwd[2], bwd[0], bwd[1], bwd[2]))
        self._cur.synced = self._cur.synced or synced
        self._bwd = None
        self._counted = False

    # ---- buckets (called by the reducer) --------------------------------------------------
    def bucket_ready(self, index: int, last_param: str | None = None) -> None:
        ev = self._bucket_events.setdefault(index, BucketEvents(index))
        ev.ready, ev.last_param = time.perf_counter(), last_param

    def bucket_launched(self, index: int) -> None:
        self._bucket_events.setdefault(index, BucketEvents(index)).launch = time.perf_counter()

    def watch_bucket(self, index: int, future: torch.futures.Future) -> None:
        """Stamp the bucket's completion when the comm hook's future completes."""
        ev = self._bucket_events.setdefault(index, BucketEvents(index))

        def completed(_: torch.futures.Future) -> None:
            ev.done = time.perf_counter()

        future.then(completed)

    def bucket_done(self, index: int) -> None:
        """The bucket's all-reduce completed (for a comm hook that stamps its own future)."""
        self._bucket_events.setdefault(index, BucketEvents(index)).done = time.perf_counter()

    def bucket_waited(self, index: int) -> None:
        self._bucket_events.setdefault(index, BucketEvents(index)).waited = time.perf_counter()

    def buckets_waited(self) -> None:
        """Every bucket of this backward has been waited for (torch's DDP: backward's end).

        torch's reducer waits for its buckets one after the other, in index order, once the
        last gradient is computed: the wait passes bucket ``i`` when it and every bucket before
        it have completed. Each bucket's ``waited`` is that moment (its completion stamp, or a
        later bucket's before it; never after now: a completion callback may run just after
        the wait woke), so that the exposure is charged to the bucket that held the wait, not
        all of it to the first one.
        """
        now = time.perf_counter()
        passed = float("-inf")
        for index in sorted(self._bucket_events):
            ev = self._bucket_events[index]
            passed = min(now, max(passed, ev.done if ev.done is not None else now))
            ev.waited = passed

    # ---- optimizer (its step hooks, through OptimizerWatch) ---------------------------------
    def _optimizer_started(self) -> None:
        self._opt_start = self.stamps.now()

    def restart_optimizer_span(self) -> None:
        """An optimizer step is under way (``step(closure)``): its own time starts now.

        The closure's forward and backward ran inside the step; they are not optimizer time.
        """
        if self._opt_start is not None:
            self._opt_start = self.stamps.now()

    def _optimizer_ended(self) -> None:
        if self._opt_start is None:
            return
        end = self.stamps.now()
        self._cur.optimizer.append([self._opt_start, end])  # type: ignore[list-item]
        self._opt_start = None
        if not self._optimizer_seen:
            self._optimizer_seen = True
            self._merge_provisional()
        if self._cur.synced:
            self._close(end)

    def _merge_provisional(self) -> None:
        """The first optimizer step: the steps ended at a backward before it are its own.

        An optimizer made after the first backwards (the script builds it lazily) is not there
        when the recorder looks; the micro-batches it accumulated then were closed one step
        each, and join this step now, as if the optimizer had been seen from the start.
        """
        count, self._provisional = self._provisional, 0
        if not count or count > _MAX_WAITING_BACKWARDS or count > len(self.steps) + len(self._pending):
            return
        taken = [self._pending.pop() if self._pending else self.steps.pop() for _ in range(count)]
        taken.reverse()
        cur = self._cur
        cur.begin = taken[0].begin
        cur.forwards[:0] = [span for r in taken for span in r.forwards]
        cur.backwards[:0] = [span for r in taken for span in r.backwards]
        cur.optimizer[:0] = [span for r in taken for span in r.optimizer]
        cur.buckets[:0] = [b for r in taken for b in r.buckets]
        cur.samples += sum(r.samples for r in taken)
        cur.synced = cur.synced or any(r.synced for r in taken)
        self._step_samples -= collections.Counter(r.samples for r in taken if r.samples)
        self.step_count -= count

    # ---- steps -----------------------------------------------------------------------------
    def _close(self, end: Stamp) -> None:
        record = self._cur
        if record.samples:
            # The samples of a step: under no_sync() accumulation, several micro-batches. The
            # most frequent count is the batch (an epoch's last batch may be smaller).
            self._step_samples[record.samples] += 1
            self.batch_size = self._step_samples.most_common(1)[0][0]
        record.end = end  # type: ignore[assignment]
        self._cur = StepRecord(begin=end)  # type: ignore[arg-type]
        self._pending.append(record)
        self._resolve(wait=False)
        self.step_count += 1
        self._closed += 1
        self._gathers.step_closed(self._closed)
        if self.max_steps is not None and self.step_count >= self.max_steps:
            if self._file is not None:
                self._file.end_bounded_run()  # lockstep doctor: the run is over on every rank
            raise SystemExit(0)

    def _resolve(self, wait: bool) -> None:
        """Move closed steps whose marks are all known into :attr:`steps`, in order."""
        while self._pending:
            record = self._pending[0]
            marks = [record.begin, record.end, *_flat(record.forwards),
                     *_flat(record.backwards), *_flat(record.optimizer)]
            if not wait and not all(self.stamps.done(m) for m in marks):
                return
            r = self.stamps.resolve
            record.begin, record.end = r(record.begin, wait), r(record.end, wait)
            for spans in (record.forwards, record.backwards, record.optimizer):
                for span in spans:
                    span[:] = [r(m, wait) for m in span]
            self.steps.append(self._pending.pop(0))

    def step_phases(self, skip_warmup: bool = True, wait: bool = True) -> list[dict[str, float]]:
        """Seconds per phase of every kept step (see :func:`~lockstep.doctor.records.phases_of`).

        With ``wait=False`` steps whose CUDA events have not completed are left out.
        """
        self._resolve(wait=wait)
        steps = list(self.steps)
        first = self.step_count - len(self._pending) - len(steps)  # index of steps[0]
        drop = max(0, self.warmup - first) if skip_warmup else 0
        return [phases_of(s.to_json()) for s in steps[drop:]]

    @property
    def step_timings(self) -> list[StepTiming]:
        """One :class:`StepTiming` per backward pass (``no_sync`` ones included)."""
        r = self.stamps.resolve
        out = []
        for f0, f1, b0, b1, b2 in self._iterations:
            out.append(StepTiming(r(f1, True) - r(f0, True), r(b2, True) - r(b0, True),
                                  r(b2, True) - r(b1, True)))
        return out

    # ---- the profile ------------------------------------------------------------------------
    def payload(self) -> dict[str, Any]:
        """This rank's raw profile (what ``rank<R>.json`` holds)."""
        self._resolve(wait=True)
        first = self.step_count - len(self.steps)
        backend = self.backend
        return {
            "format": "lockstep-profile-rank", "version": 1, "rank": self.rank,
            "world_size": self.world_size, "host": socket.gethostname(), "backend": backend,
            "device": self.device.type, "device_name": _device_name(self.device),
            "torch": torch.__version__.split("+")[0], "mode": "ddp",
            "batch_size_per_rank": self.batch_size, "model": self.model_info,
            "buckets": self.layout(), "warmup": max(0, self.warmup - first),
            "wall_offset": time.time() - time.perf_counter(),
            "steps": [s.to_json() for s in self.steps],
        }

    def save(self) -> Path | None:
        """Write ``rank<R>.json`` into ``out_dir`` (once per new step); returns its path."""
        return self._file.save() if self._file is not None else None

    def close(self) -> None:
        """Stop recording: remove the optimizer hooks (and save, if ``out_dir`` is set)."""
        if self._optimizers is not None:
            self._optimizers.close()
            self._optimizers = None
        if self._file is not None:
            self._file.close()


def _flat(spans: list[list[Any]]) -> list[Any]:
    return [m for span in spans for m in span]


def _device_name(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return None
