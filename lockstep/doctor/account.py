"""The speedup account: from the ideal N× to the measured speedup, every loss with its share.

With the same batch per rank, N ranks do N times the work of one per step, so the measured
speedup is ``N * T1 / TN`` (step times at world 1 and N), and the loss is
``N - speedup = N * (TN - T1) / TN``. A script that splits a global batch over its workers
(batch ``B1`` alone, ``BN`` per worker at N) is compared by samples per second: world 1's
step time and phases are scaled to ``BN`` samples (``T1 * BN / B1``, assuming time grows with
the batch), which gives the speedup ``N * BN * T1 / (B1 * TN)`` and the same account, with
``T1`` so scaled. ``TN - T1`` splits into: each phase's growth on the ranks that waited, the
time they waited for the slowest rank, the communication the slowest rank itself waited for,
and what is left (host time outside the measured phases, and noise), printed as "unexplained". Each term ``d`` costs ``N * d / TN`` of speedup.

A loader slow on every rank looks like a straggler in ``data``: the ranks whose loaders prefetch
while they wait at the all-reduce hide their slowness, and one rank shows it. When world 1's
data time holds most of that rank's excess (:data:`DATA_BOUND_SHARE`), the job is data-bound on
every rank: one data line (the wait and the data time against world 1's), no straggler line.

An action's estimated gain is the speedup with its saving taken out of ``TN`` and, where world 1
holds the same slowness (a slow loader), out of ``T1`` too, less the measured speedup; it is
never more than what is left to the ideal (``N - measured``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DATA_BOUND_SHARE", "Account", "Action", "Loss", "speedup_account"]

_MB = 2**20
# A straggler in data whose excess world 1 holds at least this share of: every rank's loader
# is slow (world 1 has no one to hide behind), not one rank's.
DATA_BOUND_SHARE = 0.5
_PHASE_LINES = ("data", "forward", "backward", "optimizer")  # "<phase> slower than alone" lines


@dataclass
class Loss:
    """One line of the account: seconds per step at world N, and the speedup it costs."""

    key: str
    label: str
    seconds: float
    speedup: float


@dataclass
class Action:
    """A change worth trying, with the measured reason and its estimated gain in speedup."""

    gain: float
    text: str


@dataclass
class Account:
    world_size: int
    step_1: float
    step_n: float
    ideal: float
    measured: float
    losses: list[Loss]
    unexplained: Loss
    actions: list[Action] = field(default_factory=list)
    batch_1: int | None = None  # batch per worker at world 1 and at world N (None: not seen)
    batch_n: int | None = None
    data_bound: bool = False  # the data straggler is every rank's slow loader (module docstring)

    @property
    def scale(self) -> float:
        """World 1's time is scaled by this to world N's batch per worker (1: the same batch)."""
        if self.batch_1 and self.batch_n and self.batch_1 != self.batch_n:
            return self.batch_n / self.batch_1
        return 1.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """The account as printed by ``lockstep doctor``."""
        n = self.world_size
        if self.scale == 1.0:
            lines = [(f"step time: 1 worker {self.step_1 * 1e3:.1f} ms, {n} workers "
                      f"{self.step_n * 1e3:.1f} ms (same batch per worker)")]
        else:
            lines = [
                (f"step time: 1 worker {self.step_1 * 1e3:.1f} ms with batch {self.batch_1}, "
                 f"{n} workers {self.step_n * 1e3:.1f} ms with batch {self.batch_n} per worker"),
                (f"the batch per worker differs (the script splits its batch over the workers): "
                 f"speedup in samples per second; 1 worker's times scaled by {self.batch_n}/"
                 f"{self.batch_1} ({self.step_1 * self.scale * 1e3:.1f} ms), as if time grew "
                 "with the batch"),
            ]
        lines += [
            f"ideal {self.ideal:.2f}x -> measured {self.measured:.2f}x",
            f"  {'speedup':>8} {'ms/step':>8}  where it went",
        ]
        for loss in [*self.losses, self.unexplained]:
            lines.append(f"  {-loss.speedup:>+7.2f}x {loss.seconds * 1e3:>8.1f}  {loss.label}")
        total = self.ideal - sum(x.speedup for x in [*self.losses, self.unexplained])
        lines.append(f"  {total:>7.2f}x {'':>8}  = measured speedup")
        if self.measured > self.ideal:
            lines.append(f"  (above the ideal {self.ideal:.2f}x: the runs were noisy, e.g. the "
                         "1-worker run slowed by other load; rerun on a quieter machine)")
        if self.actions:
            lines.append("what to try first:")
            for i, act in enumerate(self.actions, 1):
                lines.append(f"  {i}. {act.text} (est. +{act.gain:.2f}x)")
        return "\n".join(lines)


def speedup_account(one: dict[str, Any], many: dict[str, Any]) -> Account:
    """The account of ``many`` (a profile at world N) against ``one`` (the same script at 1).

    Raises:
        ValueError: ``one`` is not a world-1 profile, or a profile has no steps.
    """
    if one["world_size"] != 1:
        raise ValueError(f"speedup_account: the baseline profile has world_size "
                         f"{one['world_size']}; run the script with 1 worker for it")
    if not one["steps"] or not many["steps"]:
        raise ValueError("speedup_account: a profile has no steps after warm-up; run more steps")
    n, att = many["world_size"], many["attribution"]
    b1, bn = one.get("batch_size_per_rank"), many.get("batch_size_per_rank")
    # a global batch split over the workers: compare samples per second (the module docstring)
    scale = bn / b1 if b1 and bn and b1 != bn else 1.0
    p1 = {k: v * scale for k, v in one["phases"].items()}
    t1, tn = p1["step"], many["phases"]["step"]
    base = att["baseline"]

    def x(seconds: float) -> float:
        return n * seconds / tn

    losses: list[Loss] = []
    straggler = att["straggler"]
    bound = n > 1 and _data_bound(straggler, p1, base)
    if n > 1:
        bucket = att["exposed_bucket"]
        where = f": {_bucket_text(bucket, many)}" if bucket else ""
        comm = att["exposed_comm_s"] - p1["exposed_comm"]
        losses.append(Loss("exposed_comm", f"exposed communication{where}", comm, x(comm)))
        if bound:
            # one line: the others' wait for the slowest loader, and the waiting ranks' data
            # time against world 1's (until 2026-11-29 two large lines offsetting each other)
            d = straggler["waited_s"] + base["data"] - p1["data"]
            slowest = base["data"] + straggler["phase_excess_s"]
            losses.append(Loss("data", (
                f"data, slow on every rank ({p1['data'] * 1e3:.1f} ms alone, "
                f"{slowest * 1e3:.1f} ms on the slowest rank; the others' loaders fill their "
                "wait at the all-reduce)"), d, x(d)))
        else:
            label = (f"straggler rank {straggler['rank']} in {straggler['phase']} (the others "
                     f"wait for it)" if straggler["rank"] is not None
                     else "imbalance between ranks (no single straggler)")
            losses.append(Loss("straggler", label, straggler["waited_s"],
                               x(straggler["waited_s"])))
    for phase in ("forward", "backward", "optimizer") if bound else _PHASE_LINES:
        d = base[phase] - p1[phase]
        alone = "alone" if scale == 1.0 else "alone, scaled to the batch"
        losses.append(Loss(phase, f"{phase} slower than {alone} ({p1[phase] * 1e3:.1f} -> "
                                  f"{base[phase] * 1e3:.1f} ms)", d, x(d)))
    rest = (tn - t1) - sum(loss.seconds for loss in losses)
    unexplained = Loss("unexplained", "unexplained (host time outside the measured phases, "
                                      "timing noise)", rest, x(rest))
    account = Account(n, one["phases"]["step"], tn, float(n), n * t1 / tn, losses, unexplained,
                      batch_1=b1, batch_n=bn, data_bound=bound)
    account.losses.sort(key=lambda loss: -loss.speedup)
    account.actions = _actions(account, one, many)[:3]
    return account


def _data_bound(straggler: dict[str, Any], p1: dict[str, float], base: dict[str, float]) -> bool:
    """A straggler in data whose excess world 1 mostly holds too: every rank's loader is slow."""
    excess = straggler["phase_excess_s"]
    return (straggler["rank"] is not None and straggler["phase"] == "data" and excess > 0
            and p1["data"] - base["data"] >= DATA_BOUND_SHARE * excess)


def _bucket_text(bucket: dict[str, Any], profile: dict[str, Any]) -> str:
    who = (f", ready when {bucket['last_param']} arrives {bucket['ready_share']:.0%} into "
           "backward") if bucket["last_param"] else ""
    return f"bucket {bucket['index']} ({bucket['bytes'] / _MB:.2f} MB{who})"


def _actions(acc: Account, one: dict[str, Any], many: dict[str, Any]) -> list[Action]:
    """Changes derived from the measurements, best estimated gain first."""
    n, tn, t1 = acc.world_size, acc.step_n, acc.step_1 * acc.scale
    att, loss = many["attribution"], {x.key: x for x in acc.losses}
    out: list[Action] = []

    def gain(saved_s: float, saved_1: float = 0.0) -> float:
        """The speedup with ``saved_s`` out of TN (and ``saved_1`` out of T1), less measured."""
        return n * max(t1 - saved_1, 0.0) / max(tn - saved_s, 1e-9) - acc.measured

    strag = att["straggler"]
    base = att["baseline"]
    p1_data = one["phases"]["data"] * acc.scale
    if acc.data_bound:
        wait = strag["waited_s"]
        slowest = base["data"] + strag["phase_excess_s"]
        out.append(Action(gain(wait, max(0.0, p1_data - base["data"])), (
            f"every rank waits for its data ({p1_data * 1e3:.1f} ms per step alone, "
            f"{slowest * 1e3:.1f} ms on the slowest of {n} ranks; rank {strag['rank']} only "
            "shows it, the others' loaders catch up while they wait at the all-reduce): the job "
            "is data-bound, not one slow rank. On every rank give the DataLoader more workers "
            "(num_workers), pin_memory/prefetch_factor, or make loading cheaper; the step "
            f"would take about {(tn - wait) * 1e3:.1f} ms instead of {tn * 1e3:.1f} ms, though "
            "the 1-worker run speeds up as well")))
    elif strag["rank"] is not None:
        r, ms = strag["rank"], strag["phase_excess_s"] * 1e3
        text = {
            "data": f"rank {r} waits {ms:.1f} ms longer for data than the others: give its "
                    "DataLoader more workers (num_workers) or pin_memory/prefetch_factor, or "
                    "check what else that host runs",
            "forward": f"rank {r} is {ms:.1f} ms slower in forward: check its device (clock, "
                       "thermal, another process on it) or its inputs (longer sequences?)",
            "backward": f"rank {r} is {ms:.1f} ms slower in backward: check its device and "
                        "its inputs",
            "optimizer": f"rank {r} is {ms:.1f} ms slower in the optimizer step: check its "
                         "device",
        }.get(strag["phase"], f"rank {r} is {ms:.1f} ms slower outside the measured phases "
                              "(logging, checkpointing, evaluation on that rank only?)")
        # the same slowness in the 1-worker run (its own share of the rank's excess) goes too
        phase = strag["phase"] or ""
        alone = one["phases"].get(phase, 0.0) * acc.scale
        saved_1 = min(max(0.0, alone - base.get(phase, alone)), strag["phase_excess_s"])
        out.append(Action(gain(strag["waited_s"], saved_1), text))
    if strag["rank"] is None and strag["waited_s"] > 0.05 * tn:
        out.append(Action(gain(strag["waited_s"] / 2), (
            f"the ranks take turns being the slowest and wait {strag['waited_s'] * 1e3:.1f} ms "
            "per step for each other: step times vary, which synchronisation turns into "
            "waiting; look for contention (other processes on the machine or device, too many "
            "threads per worker) or inputs of varying size")))
    comm = loss.get("exposed_comm")
    bucket = att["exposed_bucket"]
    # buckets not observed: the script registered its own comm hook before the first forward,
    # so another one is refused and no bucket can be named
    observed = att.get("buckets_observed", True)
    if comm is not None and comm.seconds > 0:
        exposed = comm.seconds
        bw = att["busbw"]
        bw_text = f" at {bw / 1e9:.2f} GB/s bus bandwidth" if bw > 0 else ""
        if observed:
            out.append(Action(gain(exposed / 2), (
                f"{exposed * 1e3:.1f} ms of all-reduce per step is not hidden{bw_text}: "
                "compress gradients for the wire (model.register_comm_hook(None, "
                "lockstep.bf16_compress_hook)) to halve the bytes")))
        cap = round(bucket["bytes"] / _MB / 4, 2) if bucket is not None else 0.0
        if observed and bucket is not None and bucket["last_param"] and cap >= 0.01:
            # (cap < 0.01: the bucket is one small tensor)
            out.append(Action(gain(min(exposed, bucket["exposed_s"]) / 2), (
                f"bucket {bucket['index']} ({bucket['bytes'] / _MB:.2f} MB) is ready only when "
                f"{bucket['last_param']} arrives, {bucket['ready_share']:.0%} into backward, "
                f"and its all-reduce is left exposed: a smaller bucket_cap_mb (e.g. {cap}) "
                "sends the gradients that arrive before it earlier, leaving less to wait for")))
        work = max(tn - exposed, 1e-9)
        batch = many.get("batch_size_per_rank")
        bigger = n * 2 * t1 / (2 * work + exposed) - acc.measured
        out.append(Action(max(0.0, bigger), (
            f"communication is fixed per step while compute grows with the batch: double the "
            f"batch per worker{f' ({batch} -> {2 * batch})' if batch else ''}, or accumulate 2 "
            "micro-batches under model.no_sync() if memory is short")))
    opt = loss.get("optimizer")
    if opt is not None and many["phases"]["optimizer"] > 0.15 * tn:
        share = many["phases"]["optimizer"] / tn
        out.append(Action(gain(many["phases"]["optimizer"] * (1 - 1 / n)), (
            f"the optimizer step is {share:.0%} of the step and every rank repeats it: "
            "lockstep.ZeroRedundancyOptimizer shards it (or use a fused/foreach optimizer)")))
    for phase in ("forward", "backward"):
        grown = loss.get(phase)
        if grown is not None and grown.seconds > 0.05 * tn:
            out.append(Action(gain(grown.seconds), (
                f"{phase} takes {grown.seconds * 1e3:.1f} ms longer per step than on one "
                "worker alone: the workers compete for the machine (CPU cores, memory "
                "bandwidth; OMP_NUM_THREADS per worker) or for the device")))
    if one.get("mode") == "dp" or many.get("mode") == "dp":
        out.append(Action(0.0, "replace DataParallel with DistributedDataParallel: no "
                               "replication or gather on device 0 each step"))
    # No estimate pushes the speedup past the ideal: a model that misses a cost the 1-worker
    # run shares (until 2026-11-29: a straggler's slowness held by the baseline too) could.
    room = max(0.0, n - acc.measured)
    for action in out:
        action.gain = min(max(0.0, action.gain), room)
    first = out[:1] if acc.data_bound else []  # the diagnosis, whatever its speedup gain
    return first + sorted(out[len(first):], key=lambda a: -a.gain)
