"""``profile.json`` (docs/profile-format.md) built from every rank's ``rank<R>.json``.

The ranks' steps are aligned by index (every rank runs the same steps), warm-up steps dropped,
and bucket events put on one clock: ``time.perf_counter`` is one clock for every process of a
machine; ranks on different machines are placed with each one's wall-clock offset.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lockstep.doctor.records import PHASES, phases_of

__all__ = [
    "TIMELINE_STEPS",
    "bucket_stats",
    "build_profile",
    "busbw",
    "load_ranks",
    "step_matrix",
    "steps_ended_in_warmup",
    "timeline",
]

TIMELINE_STEPS = 4  # steps per rank kept in profile.json for the timeline and the trace
OUTLIER = 3.0  # steps longer than this many fast steps are left out of the figures


def load_ranks(folder: str | Path) -> list[dict[str, Any]]:
    """Every ``rank<R>.json`` in ``folder``, ordered by rank.

    Raises:
        FileNotFoundError: none was written (the message says why that happens).
    """
    paths = sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0))
    if not paths:
        raise FileNotFoundError(
            f"no rank*.json in {folder}: the script built no lockstep.DistributedDataParallel "
            "(wrap the model with it, or with lockstep.Runtime.wrap, even at world 1), nor a "
            "torch.nn.parallel.DistributedDataParallel, nor (in a single process) a model whose "
            "parameters a torch.optim optimizer steps; or it ended before its first step, or "
            "its ranks failed to write their profile at exit (their error is in the workers' "
            "output above). A model sharded with fully_shard (torch's or lockstep's) has no "
            "DistributedDataParallel to observe: the doctor does not explain it yet"
        )
    return [json.loads(p.read_text()) for p in paths]


def steps_ended_in_warmup(ranks: list[dict[str, Any]], warmup: int) -> int | None:
    """How many steps a run took that ended within its ``warmup`` steps (None: it did not).

    A rank file's ``warmup`` is what is left of the warm-up among its kept steps, so a rank
    that ended in warm-up ran ``warmup - that + len(steps)`` steps.
    """
    short = [r for r in ranks if len(r["steps"]) <= r.get("warmup", 0)]
    if not short:
        return None
    return min(max(0, warmup - r.get("warmup", 0)) + len(r["steps"]) for r in short)


def _offsets(ranks: list[dict[str, Any]]) -> list[float]:
    """Per-rank shift onto one clock: none on one machine, wall-clock offsets across machines."""
    if len({r["host"] for r in ranks}) == 1:
        return [0.0] * len(ranks)
    return [r["wall_offset"] - ranks[0]["wall_offset"] for r in ranks]


def aligned_steps(ranks: list[dict[str, Any]], trim: bool = True) -> list[list[dict[str, Any]]]:
    """``[rank][step]`` raw steps after warm-up, truncated to the steps every rank has.

    With ``trim``, steps longer than :data:`OUTLIER` times a fast step (the 20th percentile)
    are left out on every rank (a pre-empted process, an evaluation or a checkpoint inside the
    loop): one such step would otherwise outweigh dozens of ordinary ones in every mean. The
    profile reports how many were left out (``steps_left_out``).
    """
    kept = [r["steps"][r.get("warmup", 0):] for r in ranks]
    n = min(len(k) for k in kept)
    aligned = [k[len(k) - n:] for k in kept]  # the most recent n: ranks may end mid-step
    if not trim or n == 0:
        return aligned
    durations = [statistics.fmean(s[k]["end"] - s[k]["begin"] for s in aligned) for k in range(n)]
    limit = OUTLIER * sorted(durations)[len(durations) // 5]
    keep = [k for k in range(n) if durations[k] <= limit]
    return [[s[k] for k in keep] for s in aligned]


def step_matrix(ranks: list[dict[str, Any]]) -> list[list[dict[str, float]]]:
    """``[rank][step]`` seconds per phase (plus ``step``), aligned across ranks."""
    return [[phases_of(s) for s in steps] for steps in aligned_steps(ranks)]


def busbw(nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth (nccl-tests): algorithm bandwidth ``bytes/s`` times ``2(n-1)/n``."""
    if seconds <= 0 or world_size < 2:
        return 0.0
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def bucket_stats(ranks: list[dict[str, Any]], critical: list[int] | None = None
                 ) -> list[dict[str, Any]]:
    """Per bucket: size, parameters, mean ready time, all-reduce time, bus bandwidth, exposure.

    Exposure is read on each step's ``critical`` rank (the slowest one): the others' waits
    include waiting for it, which is not communication. The all-reduce of one step lasts from the last rank's launch (a collective cannot progress
    before that) to the last rank's completion; the rank that launched last measures the wire.
    """
    layout = {b["index"]: b for b in ranks[0].get("buckets", [])}
    steps, offsets = aligned_steps(ranks), _offsets(ranks)
    acc: dict[int, dict[str, list[float]]] = {}
    last: dict[int, dict[str, int]] = {}
    for k in range(len(steps[0]) if steps else 0):
        per_bucket: dict[int, list[tuple[dict[str, Any], float, list[float]]]] = {}
        for r, rank_steps in enumerate(steps):
            step = rank_steps[k]
            if not step["backwards"] or not step["buckets"]:
                continue
            # Exposure starts when the backward's compute ends, per backward: a step that
            # accumulates without no_sync() reduces its buckets in every backward.
            previous: dict[int, float] = {}
            for ev in step["buckets"]:
                j = _backward_of(ev, step["backwards"])
                bwd = step["backwards"][j]
                per_bucket.setdefault(ev["index"], []).append((ev, offsets[r], bwd))
                if ev["waited"] is not None and (critical is None or critical[k] == r):
                    since = max(previous.get(j, bwd[1]), bwd[1])
                    exposed = max(0.0, ev["waited"] - since)
                    acc.setdefault(ev["index"], {}).setdefault("exposed", []).append(exposed)
                    previous[j] = max(since, ev["waited"])
        for index, seen in per_bucket.items():
            a = acc.setdefault(index, {})
            # Reductions of this bucket per step on one rank (more than one when a step
            # accumulates without no_sync() and every backward reduces).
            a.setdefault("per_step", []).append(len(seen) / len(steps))
            for ev, off, bwd in seen:
                if ev["ready"] is not None:
                    a.setdefault("ready", []).append(ev["ready"] - bwd[0])
                    span = bwd[1] - bwd[0]
                    if span > 0:
                        # The last bucket is stamped when DDP hands it over, a little after its
                        # last gradient (backward's compute end): at most all of backward.
                        share = min(1.0, (ev["ready"] - bwd[0]) / span)
                        a.setdefault("ready_share", []).append(share)
                if ev["last_param"]:
                    names = last.setdefault(index, {})
                    names[ev["last_param"]] = names.get(ev["last_param"], 0) + 1
            launches = [ev["launch"] + off for ev, off, _ in seen if ev["launch"] is not None]
            finished = [(_done(ev), off) for ev, off, _ in seen]
            dones = [d + off for d, off in finished if d is not None]
            if len(launches) == len(seen) == len(dones):
                a.setdefault("allreduce", []).append(max(0.0, max(dones) - max(launches)))
    world = ranks[0]["world_size"]
    out = []
    for index in sorted(set(layout) | set(acc)):
        info, a = layout.get(index, {"bytes": 0, "params": []}), acc.get(index, {})
        seconds = _mean(a.get("allreduce"))
        names = last.get(index, {})
        out.append({
            "index": index, "bytes": info["bytes"], "params": info["params"],
            "ready": _mean(a.get("ready")), "ready_share": _mean(a.get("ready_share")),
            "allreduce": seconds,
            "busbw": busbw(info["bytes"], seconds, world),
            "exposed": _mean(a.get("exposed")),
            "per_step": _mean(a.get("per_step")) or 1.0,
            "last_param": max(names, key=lambda n: names[n]) if names else None,
        })
    return out


def _backward_of(ev: dict[str, Any], backwards: list[list[float]]) -> int:
    """The index of the backward that made bucket event ``ev``: the last one that had begun by
    the event's first mark (a step that accumulates without ``no_sync()`` has several)."""
    at = next((ev[k] for k in ("ready", "launch", "waited") if ev.get(k) is not None), None)
    if at is None:
        return len(backwards) - 1
    return max((j for j, b in enumerate(backwards) if b[0] <= at), default=0)


def _done(ev: dict[str, Any]) -> float | None:
    # The future's callback may run just after the waiter wakes: the wait's end bounds it.
    done, waited = ev["done"], ev["waited"]
    if done is None:
        return waited
    return done if waited is None else min(done, waited)


def _mean(values: list[float] | None) -> float:
    return statistics.fmean(values) if values else 0.0


def _phase_means(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = (*PHASES, "step")
    return {k: _mean([row[k] for row in rows]) for k in keys}


def build_profile(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``profile.json`` object for one run (format and extra fields: see the docs).

    Raises:
        ValueError: the run ended within its warm-up (no step is left to measure).
    """
    from lockstep.doctor.attribution import attribute, critical_steps

    first = ranks[0]
    matrix = step_matrix(ranks)
    if not matrix or not matrix[0]:
        raise ValueError("build_profile: no rank has a step after its warm-up steps; the run "
                         "ended within its warm-up: lower the warm-up or let it run longer")
    critical = critical_steps(matrix) if matrix and matrix[0] else None
    per_rank = [
        {"rank": r["rank"], "host": r["host"], "phases": _phase_means(rows)}
        for r, rows in zip(ranks, matrix)
    ]
    everything = [row for rows in matrix for row in rows]
    buckets = bucket_stats(ranks, critical)
    profile: dict[str, Any] = {
        "format": "lockstep-profile", "version": 1, "world_size": first["world_size"],
        "backend": first["backend"], "device": first["device"], "torch": first["torch"],
        "mode": first.get("mode", "ddp"), "batch_size_per_rank": first["batch_size_per_rank"],
        "steps": len(matrix[0]) if matrix else 0,
        "steps_left_out": len(aligned_steps(ranks, trim=False)[0]) - len(matrix[0]),
        "model": first["model"],
        "phases": _phase_means(everything), "buckets": buckets, "per_rank": per_rank,
    }
    if first.get("device_name"):
        profile["device_name"] = first["device_name"]
    profile["attribution"] = attribute(profile, matrix).to_json()
    profile["timeline"] = timeline(ranks, TIMELINE_STEPS)
    return profile


def timeline(ranks: list[dict[str, Any]], last: int | None = None) -> dict[str, Any]:
    """The ``last`` aligned steps (all: None) of every rank on one clock, seconds from the first."""
    steps, offsets = aligned_steps(ranks, trim=False), _offsets(ranks)
    chosen = [s[-last:] if last else s for s in steps]
    if not chosen or not chosen[0]:
        return {"ranks": []}
    zero = min(s[0]["begin"] + off for s, off in zip(chosen, offsets))

    def shift(x: float | None, off: float) -> float | None:
        return None if x is None else x + off - zero

    out = []
    for rank_steps, off in zip(chosen, offsets):
        rows = []
        for s in rank_steps:
            rows.append({
                "begin": shift(s["begin"], off), "end": shift(s["end"], off),
                "forwards": [[shift(x, off) for x in span] for span in s["forwards"]],
                "backwards": [[shift(x, off) for x in span] for span in s["backwards"]],
                "optimizer": [[shift(x, off) for x in span] for span in s["optimizer"]],
                "buckets": [{**ev, **{k: shift(ev[k], off) for k in
                                      ("ready", "launch", "done", "waited")}}
                            for ev in s["buckets"]],
            })
        out.append(rows)
    return {"ranks": out}
