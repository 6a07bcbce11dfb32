"""Pictures of a profile: a PNG timeline (one lane per rank) and a Chrome trace.

Both read the ``timeline`` of ``profile.json`` (or :func:`~lockstep.doctor.profile_file.timeline`
for every step): per rank, steps with their spans on one clock. The trace opens in Perfetto
(ui.perfetto.dev) and ``chrome://tracing``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["COLORS", "plot_timeline", "spans", "write_trace"]

COLORS = {
    "data": "#b0b0b0", "forward": "#4c72b0", "backward": "#55a868", "exposed wait": "#c44e52",
    "optimizer": "#8172b2", "all-reduce": "#dd8452",
}


def spans(step: dict[str, Any]) -> Iterator[tuple[str, str, float, float]]:
    """``(lane, name, start, end)`` of one step: lane "compute" or "comm"."""
    if step["forwards"]:
        first = step["forwards"][0][0]
        # from the last optimizer step before the forward (a second optimizer), as phases_of
        begin = max([step["begin"], *(e for _, e in step["optimizer"] if e <= first)])
        yield "compute", "data", begin, first
    for s, m, e in step["forwards"]:
        if m > s:
            yield "compute", "exposed wait", s, m  # buffer broadcast before the forward
        yield "compute", "forward", m, e
    for s, c, e in step["backwards"]:
        yield "compute", "backward", s, c
        if e > c:
            yield "compute", "exposed wait", c, e
    for s, e in step["optimizer"]:
        yield "compute", "optimizer", s, e
    for ev in step["buckets"]:
        done = ev["done"] if ev["done"] is not None else ev["waited"]
        if ev["launch"] is not None and done is not None:
            yield "comm", f"all-reduce bucket {ev['index']}", ev["launch"], done


def write_trace(timeline: dict[str, Any], path: str | Path, title: str = "lockstep") -> Path:
    """Write the Chrome-trace JSON (one process per rank, a compute and a comm thread)."""
    events: list[dict[str, Any]] = []
    for rank, steps in enumerate(timeline["ranks"]):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"{title} rank {rank}"}})
        for tid, lane in enumerate(("compute", "comm")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": lane}})
        for k, step in enumerate(steps):
            events.append({"ph": "X", "name": f"step {k}", "cat": "step", "pid": rank,
                           "tid": 0, "ts": step["begin"] * 1e6,
                           "dur": (step["end"] - step["begin"]) * 1e6})
            for lane, name, start, end in spans(step):
                events.append({"ph": "X", "name": name, "cat": lane, "pid": rank,
                               "tid": 0 if lane == "compute" else 1, "ts": start * 1e6,
                               "dur": max(0.0, end - start) * 1e6})
            for ev in step["buckets"]:
                if ev["ready"] is not None:
                    events.append({"ph": "i", "s": "t", "name": f"bucket {ev['index']} ready",
                                   "cat": "comm", "pid": rank, "tid": 1, "ts": ev["ready"] * 1e6,
                                   "args": {"last_param": ev["last_param"]}})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def plot_timeline(timeline: dict[str, Any], path: str | Path, title: str) -> Path:
    """Draw the steps of every rank: phases on top, bucket all-reduces below, in ms."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = timeline["ranks"]
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.9 * len(ranks)))
    for rank, steps in enumerate(ranks):
        y = len(ranks) - 1 - rank  # rank 0 on top
        for step in steps:
            for lane, name, start, end in spans(step):
                if lane == "compute":
                    color, y0, h = COLORS[name], y + 0.35, 0.5
                else:
                    index = int(name.rsplit(" ", 1)[1])
                    color, y0, h = COLORS["all-reduce"], y + 0.05, 0.25
                    ax.text(start * 1e3, y0 + h / 2, f" {index}", fontsize=7,
                            va="center", ha="left", clip_on=True)
                ax.broken_barh([(start * 1e3, max(end - start, 0.0) * 1e3)], (y0, h),
                               facecolors=color, edgecolors="white", linewidth=0.3)
            ax.vlines(step["begin"] * 1e3, y, y + 0.9, color="black", linewidth=0.8)
    ax.set_yticks([len(ranks) - 1 - r + 0.45 for r in range(len(ranks))],
                  [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(-0.1, len(ranks) + 0.05)
    ax.set_xlabel("time (ms).  Black ticks: step boundaries.  Upper row: phases (white: other "
                  "host time).  Lower row: bucket all-reduces, launch to completion (number = "
                  "bucket).", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.93),
               ncol=len(COLORS), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
