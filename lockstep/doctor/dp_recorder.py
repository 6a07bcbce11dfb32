"""The DataParallel profile: where one process's step goes when it drives several devices.

Per step: ``scatter`` (splitting the batch), ``replicate`` (copying the model to every device),
``parallel_apply`` (the replicas' forwards, and each device's own time in ``devices``),
``gather`` (outputs or losses brought to the output device: device 0's extra work),
``loss`` (the loss computed on the output device from the gathered outputs, when the training
loop marks it with ``mark("loss")``: more of device 0's extra work; otherwise it is in ``other``),
``backward`` (all replicas' gradients flowing back into the module on device 0), ``optimizer``,
and ``other`` (the rest of the step: data, the loss outside the wrapper). On CUDA the
per-device times are the host's launch times (kernels run on asynchronously).
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lockstep._torch_compat import queue_callback
from lockstep.doctor.optimizer_watch import OptimizerWatch

__all__ = ["DP_PHASES", "DataParallelRecorder"]

DP_PHASES = ("scatter", "replicate", "parallel_apply", "gather", "loss", "backward", "optimizer",
             "other")


class DataParallelRecorder:
    """Records the phases of every step of one :class:`lockstep.DataParallel`."""

    def __init__(self, params: Iterable[torch.Tensor], devices: int, warmup: int = 3,
                 history: int = 2000) -> None:
        self.devices, self.warmup = devices, warmup
        self.steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self.step_count = 0
        self._begin = time.perf_counter()
        self._new_step()
        self._optimizers = OptimizerWatch(params, self._optimizer_started, self._optimizer_ended)

    def _new_step(self) -> None:
        self._cur: dict[str, Any] = {p: 0.0 for p in DP_PHASES}
        self._cur["devices"] = [0.0] * self.devices
        self._last = time.perf_counter()
        self._backward_start: float | None = None
        self._opt_start: float | None = None

    # ---- forward (called by DataParallel.forward) ------------------------------------------
    def forward_started(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in ``phase`` (one of :data:`DP_PHASES`).

        The wrapper marks its four steps; a training loop may call ``mark("loss")`` right after
        computing the loss from the gathered outputs, so device 0's loss is its own phase.
        """
        now = time.perf_counter()
        self._cur[phase] += now - self._last
        self._last = now

    def timed_call(self, device: int, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timing its run (in its own thread) as ``device``'s."""
        times = self._cur["devices"]

        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                times[device] += time.perf_counter() - start

        return run

    def forward_ended(self, output: Any) -> None:
        """Mark backward's start and end through the first output that needs a gradient."""
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._backward_started)
                return

    def _backward_started(self, grad: torch.Tensor) -> None:
        if self._backward_start is None:
            self._backward_start = time.perf_counter()
            queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        if self._backward_start is not None:
            self._cur["backward"] += time.perf_counter() - self._backward_start
            self._backward_start = None

    # ---- optimizer: the step ends with it ---------------------------------------------------
    def _optimizer_started(self) -> None:
        self._opt_start = time.perf_counter()

    def _optimizer_ended(self) -> None:
        if self._opt_start is None:
            return
        end = time.perf_counter()
        self._cur["optimizer"] += end - self._opt_start
        self._cur["step"] = end - self._begin
        measured = sum(self._cur[p] for p in DP_PHASES if p != "other")
        self._cur["other"] = max(0.0, self._cur["step"] - measured)
        self.steps.append(self._cur)
        self.step_count += 1
        self._begin = end
        self._new_step()

    # ---- results ------------------------------------------------------------------------------
    def phases(self) -> dict[str, Any]:
        """Mean seconds per phase over the kept steps after warm-up, and per device."""
        first = self.step_count - len(self.steps)
        rows = list(self.steps)[max(0, self.warmup - first):]
        if not rows:
            return {}
        out: dict[str, Any] = {p: statistics.fmean(r[p] for r in rows) for p in (*DP_PHASES, "step")}
        out["devices"] = [statistics.fmean(r["devices"][d] for r in rows)
                          for d in range(self.devices)]
        return out

    def close(self) -> None:
        self._optimizers.close()


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
