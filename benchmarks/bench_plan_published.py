"""Predict every published row in benchmarks/published/ and say how far off the planner is.

    python benchmarks/bench_plan_published.py            # per-row table, summary, held-out view

Each row of ``benchmarks/published/busbw.json`` is a published NCCL all-reduce bus bandwidth with
the link a user would have named. The planner prices it with its achievable-bandwidth model
(:mod:`lockstep.plan.transports`) at the optimistic, expected and pessimistic ends; the error is
in points of the line-rate bus bandwidth (what the old model predicted for that row). The
leave-one-source-out view rebuilds each transport's efficiency range from the calibration facts
of the *other* sources and predicts the held-out source's rows with it, so no constant is judged
on the rows it came from. Nothing here is fitted: the ranges are the min/median/max of the cited
figures.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from lockstep.plan import parse_topology
from lockstep.plan.costs import ALL_REDUCE, collective
from lockstep.plan.transports import BOUNDS, TRANSPORTS, Transport, achievable

HERE = Path(__file__).resolve().parent / "published"


def busbw(row: dict, bound: str | None, table: dict[str, Transport] | None = None) -> float:
    """Predicted bus bandwidth (bytes/s) of ``row``'s all-reduce; ``bound=None``: line rate."""
    topo, pm = parse_topology(row["link"]), 0.0
    if bound is not None:
        topo, pm = achievable(topo, bound, table)
    n, size = row["ranks"], row["bytes"]
    t = collective(ALL_REDUCE, size, n, topo, hierarchical=bound is None).seconds + pm
    return size / t * 2 * (n - 1) / n


def held_out_table(facts: list[dict], source: str | None) -> dict[str, Transport]:
    """The transports with each efficiency range rebuilt from the facts of the other sources."""
    table = dict(TRANSPORTS)
    for name, transport in TRANSPORTS.items():
        values = sorted(v for f in facts if f["transport"] == name and f["source"] != source
                        for v in f["efficiency"])
        if values:
            table[name] = replace(transport, efficiency=(
                values[0], statistics.median(values), values[-1]))
    return table


def judge(rows: list[dict], table: dict[str, Transport] | None) -> list[dict]:
    out = []
    for row in rows:
        line = busbw(row, None)
        pred = {b: busbw(row, b, table) for b in BOUNDS}
        measured = row["busbw_GBps"] * 1e9
        lo, hi = min(pred.values()), max(pred.values())
        out.append({"source": row["source"], "link": row["link"], "ranks": row["ranks"],
                    "bytes": row["bytes"], "measured": measured / line,
                    "predicted": pred["expected"] / line, "low": lo / line, "high": hi / line,
                    "error": (pred["expected"] - measured) / line * 100,
                    "covered": lo * 0.999 <= measured <= hi * 1.001})
    return out


def summary(judged: list[dict]) -> str:
    errs = [j["error"] for j in judged]
    within = sum(abs(e) <= 10 for e in errs)
    optimistic = sum(e > 0 for e in errs)
    covered = sum(j["covered"] for j in judged)
    return (f"{len(judged)} rows: {within}/{len(judged)} within 10 points, mean |error| "
            f"{statistics.mean(abs(e) for e in errs):.1f} points, mean signed "
            f"{statistics.mean(errs):+.1f}; optimistic {optimistic}, pessimistic "
            f"{len(errs) - optimistic}; interval covers {covered}/{len(judged)}")


def table_text(judged: list[dict]) -> str:
    head = (f"{'source':<22} {'link':<22} {'ranks':>5} {'MB':>7} {'published':>9} "
            f"{'predicted':>9} {'range':>11} {'error':>6} covered")
    lines = [head]
    for j in judged:
        lines.append(f"{j['source']:<22} {j['link']:<22} {j['ranks']:>5} {j['bytes'] / 2**20:>7.0f} "
                     f"{j['measured'] * 100:>8.0f}% {j['predicted'] * 100:>8.0f}% "
                     f"{j['low'] * 100:>4.0f}-{j['high'] * 100:<4.0f}% {j['error']:>+6.1f} "
                     f"{'yes' if j['covered'] else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    doc = json.loads((HERE / "busbw.json").read_text())
    rows, facts = doc["rows"], doc["calibration"]["facts"]
    print("bus bandwidth as a share of the line-rate model's (the old prediction = 100%)\n")
    judged = judge(rows, None)
    print(table_text(judged))
    print("\nall constants as shipped:", summary(judged))
    held: list[dict] = []
    for source in dict.fromkeys(r["source"] for r in rows):
        part = [r for r in rows if r["source"] == source]
        held += judge(part, held_out_table(facts, source))
    print("\nleave one source out (ranges rebuilt without the held-out source's figures)\n")
    print(table_text(held))
    print("\nleave one source out:", summary(held))


if __name__ == "__main__":
    main()
