"""The DataParallel section of the doctor's report, and DataParallel measured against DDP.

Pure arithmetic and text on measured phases (``DataParallelRecorder.phases()`` and a DDP
``profile.json``); :mod:`lockstep.doctor.dp_vs_ddp` runs the two and fills :class:`DPvsDDP`.

What DataParallel costs that DDP does not (issue #12): every step it copies the model to every
device (``replicate``), splits the batch (``scatter``), brings the outputs back to device 0
(``gather``) and computes the loss there (``loss``); device 0 does the last two alone while
the other devices wait. DDP pays instead for the all-reduce that backward does not hide
(``exposed_comm``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DP_OVERHEAD", "DPvsDDP", "dp_section"]

# DataParallel's phases that DDP has no counterpart for, and what each one is.
DP_OVERHEAD = {
    "replicate": "replication (the model copied to every device, every step)",
    "scatter": "scatter (the batch split across devices)",
    "gather": "gather (outputs brought to device 0)",
    "loss": "device 0's loss (on the gathered outputs)",
}
_WORK = {
    "parallel_apply": "replicas' forwards (parallel_apply)",
    "backward": "backward (every replica's gradients into device 0's module)",
    "optimizer": "optimizer",
    "other": "other (data, zero_grad, host time between phases)",
}


def dp_section(phases: dict[str, Any], devices: int) -> str:
    """The DataParallel part of the report: ms per step and share of the step, by phase.

    Args:
        phases: ``DataParallelRecorder.phases()`` (seconds per step).
        devices: how many devices the wrapper drove.
    """
    step = phases["step"]
    lines = [f"DataParallel on {devices} devices: {step * 1e3:.1f} ms per step"]
    lines.append(f"  {'share':>6} {'ms/step':>8}  phase")
    for key, label in (*DP_OVERHEAD.items(), *_WORK.items()):
        value = phases.get(key, 0.0)
        lines.append(f"  {value / step:>6.1%} {value * 1e3:>8.1f}  {label}")
    overhead = sum(phases.get(k, 0.0) for k in DP_OVERHEAD)
    device0 = phases.get("gather", 0.0) + phases.get("loss", 0.0)
    lines.append(f"  replication {phases.get('replicate', 0.0) / step:.1%}, gather "
                 f"{phases.get('gather', 0.0) / step:.1%}, device 0's extra work (gather + loss) "
                 f"{device0 / step:.1%}; all DataParallel-only work {overhead / step:.1%} "
                 f"of the step")
    return "\n".join(lines)


@dataclass
class DPvsDDP:
    """DataParallel and DDP on the same model, batch and device count, measured.

    Attributes:
        devices: the device count (DataParallel's devices, DDP's processes).
        device_type: ``"cpu"`` or ``"cuda"``.
        steps: steps measured in each run, after ``warmup`` left out.
        warmup: steps left out at the start of each run.
        dp_phases: DataParallel's seconds per step, by phase (``step`` is the whole step).
        ddp_phases: DDP's seconds per step, by phase, averaged over ranks.
        max_param_diff: largest difference between the two runs' final parameters (both
            trained on the same batches: a check that they did the same work).
        notes: how the runs were set up (threads, what runs in parallel).
    """

    devices: int
    device_type: str
    steps: int
    warmup: int
    dp_phases: dict[str, Any]
    ddp_phases: dict[str, Any]
    max_param_diff: float
    notes: list[str] = field(default_factory=list)

    @property
    def dp_step_s(self) -> float:
        return float(self.dp_phases["step"])

    @property
    def ddp_step_s(self) -> float:
        return float(self.ddp_phases["step"])

    @property
    def saving_s(self) -> float:
        """Seconds per step DDP saves (negative: DDP is slower)."""
        return self.dp_step_s - self.ddp_step_s

    @property
    def speedup(self) -> float:
        """DataParallel's step time over DDP's."""
        return self.dp_step_s / self.ddp_step_s

    def table(self) -> str:
        """The report: the DataParallel section, then DDP's step and what it saves."""
        dp_only = sum(self.dp_phases.get(k, 0.0) for k in DP_OVERHEAD)
        exposed = self.ddp_phases.get("exposed_comm", 0.0)
        head = (f"DataParallel vs DDP: {self.devices} {self.device_type} devices, {self.steps} "
                f"steps after {self.warmup} warm-up, the same model and global batch")
        ddp = (f"DDP on {self.devices} processes: {self.ddp_step_s * 1e3:.1f} ms per step "
               f"(forward {self.ddp_phases.get('forward', 0.0) * 1e3:.1f}, backward "
               f"{self.ddp_phases.get('backward', 0.0) * 1e3:.1f}, exposed all-reduce "
               f"{exposed * 1e3:.1f}, optimizer {self.ddp_phases.get('optimizer', 0.0) * 1e3:.1f})")
        verb = "save" if self.saving_s >= 0 else "cost"
        verdict = (f"DDP would {verb} {abs(self.saving_s) * 1e3:.1f} ms per step "
                   f"({abs(self.saving_s) / self.dp_step_s:.0%} of DataParallel's step; "
                   f"DataParallel/DDP step time {self.speedup:.2f}x); DataParallel-only work "
                   f"was {dp_only * 1e3:.1f} ms, DDP's exposed all-reduce {exposed * 1e3:.1f} ms")
        same = f"same training: final parameters differ by at most {self.max_param_diff:.1e}"
        lines = [head, dp_section(self.dp_phases, self.devices), ddp, verdict, same]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(dp_step_s=self.dp_step_s, ddp_step_s=self.ddp_step_s,
                   saving_s=self.saving_s, speedup=self.speedup)
        return out
