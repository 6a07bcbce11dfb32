"""A :class:`~lockstep.plan.planner.Plan` as a terminal table, a JSON document and a PNG plot."""

from __future__ import annotations

from dataclasses import asdict
from typing import Protocol

from lockstep.plan.links import Topology
from lockstep.plan.model import Prediction
from lockstep.plan.workload import Workload

__all__ = ["PlanLike", "format_table", "plan_to_dict", "save_png"]


class PlanLike(Protocol):
    """What the renderers read of a :class:`~lockstep.plan.planner.Plan`. A protocol, so this
    module imports nothing from the planner (the planner imports it: no import cycle)."""

    workload: Workload
    topology: Topology
    predictions: list[Prediction]
    assumptions: list[str]
    not_modelled: tuple[str, ...]

GB = 1e9


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _range(p) -> str:  # p: Prediction
    d = p.detail
    if "efficiency_low" not in d:
        return ""
    if d["dominant_input"] != "none":
        source = f"range from {d['dominant_input']}"
    else:  # no input moves the step towards its pessimistic end
        source = "no range" if d["step_low_s"] >= d["step_high_s"] else "nothing dominates"
    return (f"  [eff {d['efficiency_low'] * 100:.0f}-{d['efficiency_high'] * 100:.0f}%, "
            f"wait for slowest {d['straggler_s'] * 1e3:.2f} ms, {source}]")


def format_table(plan: PlanLike) -> str:
    """The predictions grouped by GPU count; ``*`` marks the best, ``~`` a non-exact strategy."""
    unit = "samples/s" if plan.workload.batch_size else "steps*GPUs/s"
    head = (f"{'GPUs':>6} {'nodes':>5}  {'strategy':<12} {'step ms':>9} {unit:>12} {'eff':>6} "
            f"{'exposed':>7} {'mem GB':>7}  {'algorithm':<12} binding")
    lines = [head, "-" * len(head)]
    last = None
    for p in plan.predictions:
        if last is not None and p.gpus != last:
            lines.append("")
        last = p.gpus
        mark = "*" if p.best else ("~" if not p.exact else " ")
        mem = f"{p.memory.total / GB:7.2f}" + ("!" if not p.fits else " ")
        lines.append(
            f"{p.gpus:>6} {p.nodes:>5} {mark}{p.strategy:<12} {p.step_s * 1e3:9.2f} "
            f"{_fmt_rate(p.samples_per_s):>12} {p.efficiency * 100:5.1f}% "
            f"{p.exposed_share * 100:6.1f}% {mem} {p.algorithm:<12} {p.binding}"
            + _range(p))
    lines += ["", ("* best exact strategy that fits   ~ changes the algorithm (check convergence)"
              "   ! model states exceed --gpu-memory"),
              "eff = step on 1 GPU with no communication / predicted step (weak scaling)",
              "", "Assumptions:"]
    lines += [f"  - {a}" for a in plan.assumptions]
    lines += ["Not modelled:"] + [f"  - {a}" for a in plan.not_modelled]
    return "\n".join(lines)


def plan_to_dict(plan: PlanLike) -> dict:
    """A JSON-ready document: format, inputs, assumptions and one record per prediction."""
    rows = []
    for p in plan.predictions:
        row = {k: v for k, v in asdict(p).items() if k != "memory"}
        row["exposed_share"] = p.exposed_share
        row["memory_bytes"] = {"parameters": p.memory.parameters, "gradients": p.memory.gradients,
                               "optimizer": p.memory.optimizer, "total": p.memory.total}
        rows.append(row)
    w, t = plan.workload, plan.topology
    return {
        "format": "lockstep-plan", "version": 1,
        "workload": {"source": w.source, "parameters": w.parameters, "grad_dtype": w.grad_dtype,
                     "batch_size": w.batch_size, "data_s": w.data, "forward_s": w.forward,
                     "backward_s": w.backward, "optimizer_s": w.optimizer,
                     "buckets": [{"bytes": b.nbytes, "ready_s": b.ready} for b in w.buckets],
                     "buffer_broadcasts": list(w.buffer_broadcasts)},
        "topology": {"intra": asdict(t.intra), "gpus_per_node": t.gpus_per_node,
                     "inter": asdict(t.inter) if t.inter else None, "nics_per_node": t.nics},
        "assumptions": list(plan.assumptions), "not_modelled": list(plan.not_modelled),
        "predictions": rows,
    }


def save_png(plan: PlanLike, path: str) -> None:
    """Scaling efficiency against GPU count, one curve per strategy; best points circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    names = list(dict.fromkeys(p.strategy for p in plan.predictions))
    for name in names:
        pts = [p for p in plan.predictions if p.strategy == name]
        style = "--" if not pts[0].exact else "-"
        line = ax.plot([p.gpus for p in pts], [p.efficiency * 100 for p in pts], style,
                       marker="o", label=name)
        if all("efficiency_low" in p.detail for p in pts):  # the low-high range, shaded
            ax.fill_between([p.gpus for p in pts],
                            [p.detail["efficiency_low"] * 100 for p in pts],
                            [p.detail["efficiency_high"] * 100 for p in pts],
                            color=line[0].get_color(), alpha=0.15)
    best = [p for p in plan.predictions if p.best]
    ax.scatter([p.gpus for p in best], [p.efficiency * 100 for p in best], s=160,
               facecolors="none", edgecolors="black", linewidths=1.5, label="best", zorder=3)
    ax.set_xscale("log", base=2)
    gpus = sorted({p.gpus for p in plan.predictions})
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set_ylim(0, max([105.0] + [p.efficiency * 100 + 5 for p in plan.predictions]))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"Predicted scaling: {plan.topology.describe()}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
