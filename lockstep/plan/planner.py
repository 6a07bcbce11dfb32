"""Predict every strategy at every GPU count and mark the best: ``lockstep.plan.plan(...)``.

Example::

    from lockstep.plan import plan, load_profile, parse_topology
    result = plan(load_profile("profile.json"), parse_topology("nvlink4:8,ib-ndr400"),
                  gpus=[8, 64, 512, 4096])
    print(result.table())
    result.save_png("plan.png")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lockstep.plan.intervals import Interval, predict_interval
from lockstep.plan.links import Topology
from lockstep.plan.model import PlanOptions, Prediction, predict
from lockstep.plan.report import format_table, plan_to_dict, save_png
from lockstep.plan.strategies import DEFAULT_STRATEGIES, Strategy, parse_strategies
from lockstep.plan.transports import BOUNDS, achievable
from lockstep.plan.workload import Workload

__all__ = ["NOT_MODELLED", "Plan", "plan"]

NOT_MODELLED = (
    "stragglers and run-to-run jitter (every GPU is assumed as fast as the profiled one)",
    ("network contention and congestion beyond the alpha-beta model (other jobs, oversubscribed "
    "switches, adaptive routing); every link delivers its stated bandwidth"),
    "compute slowed by communication kernels running beside it (SM and memory contention)",
    "activations, buffers and allocator fragmentation in memory (model states only)",
    ("convergence: local SGD/DiLoCo and compression change the updates; larger global batches "
    "may need more steps"),
    "in-network reduction (SHARP/NVLS) and NCCL protocol switching (LL/LL128/Simple)",
)


@dataclass
class Plan:
    """Predictions per GPU count and strategy, with the assumptions that produced them."""

    workload: Workload
    topology: Topology
    predictions: list[Prediction]
    assumptions: list[str] = field(default_factory=list)
    not_modelled: tuple[str, ...] = NOT_MODELLED

    def best(self, gpus: int) -> Prediction | None:
        return next((p for p in self.predictions if p.gpus == gpus and p.best), None)

    def table(self) -> str:
        return format_table(self)

    def to_dict(self) -> dict:
        return plan_to_dict(self)

    def save_png(self, path: str) -> None:
        save_png(self, path)


def plan(workload: Workload, topology: Topology, gpus: Sequence[int],
         strategies: Sequence[Strategy | str] | str | None = None,
         options: PlanOptions | None = None, intervals: bool = False) -> Plan:
    """Predict each strategy at each GPU count; the fastest exact strategy that fits is best.

    Args:
        workload: what one GPU does per step (:func:`load_profile` or :func:`describe`).
        topology: the links (:func:`parse_topology`).
        gpus: GPU counts to predict.
        strategies: names or :class:`Strategy` objects; default ``ddp, ddp-bf16, zero1, zero2,
            zero3, localsgd:8, dp``.
        intervals: predict each point at the expected inputs with a low-high range
            (:func:`~lockstep.plan.intervals.predict_interval`: achievable link bandwidth per
            transport, per-message cost, the wait for the slowest rank) and choose the best
            strategy on the pessimistic end; ``False``: the line-rate lower bound of the step.
    """
    options = options or PlanOptions()
    if not gpus or any(int(n) < 1 for n in gpus):
        raise ValueError(f"GPU counts must be positive integers, got {list(gpus)}")
    chosen: list[Strategy]
    if strategies is None:
        chosen = parse_strategies(list(DEFAULT_STRATEGIES), workload.grad_dtype)
    elif isinstance(strategies, str):
        chosen = parse_strategies(strategies, workload.grad_dtype)
    else:
        chosen = [s if isinstance(s, Strategy) else parse_strategies([s], workload.grad_dtype)[0]
                  for s in strategies]
    predictions: list[Prediction] = []
    skipped: list[int] = []  # GPU counts DataParallel cannot run at (beyond one node)
    for n in sorted({int(n) for n in gpus}):
        if intervals:
            row = [_with_range(i) for s in chosen
                   if (i := predict_interval(workload, topology, n, s, options)) is not None]
        else:
            row = [p for s in chosen
                   if (p := predict(workload, topology, n, s, options)) is not None]
        if any(s.data_parallel for s in chosen) and n > topology.gpus_per_node:
            skipped.append(n)
        ranked = [p for p in row if p.fits and p.exact] or [p for p in row if p.fits]
        if ranked:
            top = max(ranked, key=_pessimistic_rate)
            row = [_marked(p) if p is top else p for p in row]
        predictions.extend(row)
    _check_finite(workload, predictions)
    if not predictions:
        raise ValueError(_nothing_left(topology, sorted({int(n) for n in gpus})))
    ranged = intervals or options.bound is not None
    assumptions = _assumptions(workload, topology, options, ranged)
    if skipped and strategies is not None:  # asked for: say why its rows are missing
        assumptions.append(_dp_note(topology, skipped))
    not_modelled: tuple[str, ...] = NOT_MODELLED
    if ranged:
        assumptions += _ranged_assumptions(workload, options, intervals)
        # ranged: the wait for the slowest rank and the transports' achievable bandwidth are in
        not_modelled = tuple(n.replace("; every link delivers its stated bandwidth", "")
                             for n in NOT_MODELLED if not n.startswith("stragglers"))
    return Plan(workload, topology, predictions, assumptions, not_modelled)


def _dp_note(topology: Topology, skipped: list[int]) -> str:
    counts = ", ".join(str(n) for n in skipped)
    return (f"dp (single-process DataParallel) runs within one node of {topology.gpus_per_node} "
            f"GPU(s): its rows for {counts} GPUs are skipped")


def _nothing_left(topology: Topology, gpus: list[int]) -> str:
    return (f"nothing to predict: dp (single-process DataParallel) runs within one node of "
            f"{topology.gpus_per_node} GPU(s), and every GPU count asked for "
            f"({', '.join(str(n) for n in gpus)}) is beyond it; give GPU counts (--gpus) up to "
            f"{topology.gpus_per_node}, more GPUs per node (--link INTRA:GPUS), or another "
            "strategy")


def _check_finite(workload: Workload, predictions: list[Prediction]) -> None:
    """Refuse a workload whose times overflow the model (a step of inf or nan seconds)."""
    for p in predictions:
        numbers = [p.step_s, p.efficiency, p.samples_per_s,
                   *(v for v in p.detail.values() if isinstance(v, float))]
        if not (all(math.isfinite(x) for x in numbers) and p.step_s > 0):
            high = p.detail.get("step_high_s", p.step_s)
            raise ValueError(f"{workload.source}: the predicted step of {p.strategy} at {p.gpus} "
                             f"GPUs is {p.step_s:g} (up to {high:g}) seconds: the workload's "
                             f"times (forward {workload.forward:g} s, backward "
                             f"{workload.backward:g} s) are too large to price; give seconds "
                             "per step")


def _ranged_assumptions(workload: Workload, options: PlanOptions, intervals: bool) -> list[str]:
    """What the transport-aware model assumes: as intervals (a point and a range) or, with
    ``PlanOptions(bound=...)`` alone, every input at that one end."""
    cv = options.step_cv if options.step_cv is not None else workload.step_cv
    default = ("(the profile has one rank: a default calibrated on 124 published runs, "
               "docs/plan.md; measure yours at world >= 2)")
    if options.step_cv is not None:
        spread = f"{cv:.1%} (given)"
    elif cv is not None:
        spread = f"{cv:.1%} (from the profile's ranks)"
    elif intervals:
        spread = (f"{options.default_cv[0]:.1%}-{options.default_cv[2]:.1%}, expected "
                  f"{options.default_cv[1]:.1%} {default}")
    else:
        spread = f"{options.default_cv[BOUNDS.index(str(options.bound))]:.1%} {default}"
    if intervals:
        links = ("intervals: preset links at their transport's achievable bandwidth (TCP sockets, "
                 "RDMA, NVLink, PCIe; ranges cited in docs/plan.md) plus a per-message cost; the "
                 "point is the expected inputs, the range every input at its optimistic and "
                 "pessimistic end; the best strategy is chosen on the pessimistic end")
    else:
        links = (f"bound {options.bound}: preset links at their transport's achievable bandwidth "
                 f"(TCP sockets, RDMA, NVLink, PCIe; docs/plan.md) plus a per-message cost, every "
                 f"input at its {options.bound} value; one point, no range")
    return [links, ("the step waits for the slowest of N ranks: (data + forward + backward + "
                    f"optimizer + other) x spread x E[max of N normals], spread {spread}")]


def _pessimistic_rate(p: Prediction) -> float:
    """Samples/s at the slow end of the range (the point itself when there is no range)."""
    return p.samples_per_s * p.step_s / p.detail.get("step_high_s", p.step_s)


def _with_range(i: Interval) -> Prediction:
    from dataclasses import replace

    detail = dict(i.expected.detail, step_low_s=i.step_low_s, step_high_s=i.step_high_s,
                  efficiency_low=i.efficiency_low, efficiency_high=i.efficiency_high,
                  dominant_input=i.dominant)
    return replace(i.expected, detail=detail)


def _marked(p: Prediction) -> Prediction:
    from dataclasses import replace

    return replace(p, best=True)


def _collectives(topology: Topology, options: PlanOptions, ranged: bool) -> str:
    """What :func:`~lockstep.plan.model.collective` picks from in this mode."""
    if ranged and achievable(topology, "expected", options.transports)[1] > 0:
        return ("collectives pick the cheaper of ring and tree, NCCL's own algorithms (NCCL has "
                "no hierarchical all-reduce); broadcasts the cheaper of tree and chain")
    why = ("the line-rate lower bound" if not ranged else
           "no preset link, so no transport to price as NCCL runs it")
    return ("collectives pick the cheapest of ring, tree and a hierarchical schedule (reduce-"
            "scatter in the node, all-reduce across, all-gather in the node; NCCL has no such "
            f"all-reduce: {why}); broadcasts the cheaper of tree and chain")


def _assumptions(workload: Workload, topology: Topology, options: PlanOptions,
                 ranged: bool = False) -> list[str]:
    out = [
        (f"workload from {workload.source}: per GPU and step, data {workload.data * 1e3:.2f} ms, "
        f"forward {workload.forward * 1e3:.2f} ms, backward {workload.backward * 1e3:.2f} ms, "
        f"optimizer {workload.optimizer * 1e3:.2f} ms, other {workload.other * 1e3:.2f} ms, "
         f"batch {workload.batch_size}"),
        (f"{workload.parameters:,} parameters, {workload.grad_dtype} gradients in "
        f"{len(workload.buckets)} buckets"),
        f"links: {topology.describe()}",
        "weak scaling: the per-GPU batch stays the same at every GPU count",
        "compute per GPU does not change with the GPU count; one link queue, buckets in order",
        _collectives(topology, options, ranged),
        (f"optimizer state: {options.optimizer}, "
        f"{'mixed precision' if options.mixed_precision else 'precision from the gradient dtype'}"),
    ]
    if workload.buffer_broadcasts:
        out.append(f"DDP, ZeRO-1 and local SGD broadcast {sum(workload.buffer_broadcasts):,.0f} "
                   f"bytes of buffers from rank 0 before every forward "
                   f"({len(workload.buffer_broadcasts)} message(s)), never hidden")
    if options.cpu_cores is not None and workload.device == "cpu":
        share = topology.intra.cpu_share
        work = (f"{share[0]:.0%} of its latency and {share[1]:.0%} of its bandwidth term, "
                "as measured" if share is not None else "all of it: no measured CPU share")
        out.append(f"CPU ranks time-share {options.cpu_cores} cores per node with their "
                   "communication: the step is at least ranks x (compute + the collectives' CPU "
                   f"work + bucket copies) / cores; a collective's CPU work: {work}")
    if workload.device == "cpu" and options.codec_bandwidth is None:
        rate = (f"; at the optimistic end at the faster of that and the measured plain copy, "
                f"{options.copy_rate / 1e9:.1f} GB/s (that end is never slower than the point)"
                if options.copy_rate is not None else "")
        out.append(f"bucket copies priced at 5 GB/s (all of a bucket's per-byte CPU work, not "
                   f"memory's speed){rate}")
    if workload.source == "described" or any(n.startswith("synthetic") for n in workload.notes):
        out.append("bucket ready times assumed uniform in bytes over backward (no profile)")
    return out + list(workload.notes)
