"""Check the planner against this machine: profile at world 1, predict world N, run world N.

Used by ``benchmarks/bench_plan.py`` and the tests. ``build``, ``make_batch`` and ``loss_fn`` must
be module-level functions (workers are new processes): ``build() -> nn.Module``,
``make_batch() -> (inputs, targets)``, ``loss_fn(output, targets) -> loss``.

A *throttled* run registers :func:`throttle_hook`, which holds each bucket's all-reduce result
for ``2(n-1)/n * bytes / bandwidth`` seconds on the communication thread, one hold at a time:
a slow link of that bus bandwidth behind the real one. The holds form a second queue (a
bucket's hold starts once its all-reduce is done and the previous hold is over), so the real
all-reduces of later buckets run during earlier holds; :func:`predict_throttled` prices that
pipeline (:func:`held_extra`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lockstep.plan.costs import ALL_REDUCE
from lockstep.plan.links import Link, Topology
from lockstep.plan.model import (
    PlanOptions,
    Prediction,
    collective,
    predict,
    simulate_buckets,
)
from lockstep.plan.model import codec_bandwidth as copy_rate
from lockstep.plan.strategies import parse_strategy
from lockstep.plan.workload import Workload, load_profile

__all__ = [
    "SWEEP_ROUNDS", "Throttle", "cpu_cores", "held_extra", "measure_ddp", "predict_ddp",
    "predict_throttled", "predict_throttled_shared", "profile_world1", "throttle_hook",
    "workload_of",
]

SWEEP_ROUNDS = 9  # all-reduce sweep rounds a measured run does before its timed steps


class Throttle:
    """State of :func:`throttle_hook`: a bus bandwidth and the lock that makes it one link.

    gloo completes buckets on more than one thread; the lock queues the holds one after
    another, as bytes queue on a single link.
    """

    def __init__(self, bandwidth: float) -> None:
        if bandwidth <= 0:
            raise ValueError(f"throttle bandwidth must be positive, got {bandwidth}")
        self.bandwidth = bandwidth
        self.lock = threading.Lock()


def throttle_hook(state: Throttle, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A comm hook: the default all-reduce, then a hold of ``2(n-1)/n * bytes / bandwidth`` s."""
    import torch.distributed as dist

    from lockstep.comm.hooks import allreduce_hook

    n = dist.get_world_size()
    nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
    delay = 2 * (n - 1) / n * nbytes / state.bandwidth
    fut = allreduce_hook(None, bucket)

    def hold(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        with state.lock:
            time.sleep(delay)
        return f.value()

    return fut.then(hold)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _profile_worker(rank: int, build: Callable, make_batch: Callable, loss_fn: Callable,
                    steps: int, batch_size: int | None) -> dict:
    torch.manual_seed(0)
    import torch.distributed as dist

    from lockstep.ddp.wrapper import DistributedDataParallel
    from lockstep.distributed import init_distributed
    from lockstep.doctor.api import gather_report
    from lockstep.doctor.recorder import Recorder

    init_distributed()
    # Every rank trains alone (a group of one each): rank 0's profile is a world of one, the
    # others only compute beside it, as the ranks of the predicted world will.
    solos = [dist.new_group([r]) for r in range(dist.get_world_size())]
    ddp = DistributedDataParallel(build(), process_group=solos[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = make_batch()
    recorder = ddp.enable_profiling(warmup=3)
    assert isinstance(recorder, Recorder)  # the doctor's (lockstep.profilers), enabled
    dist.barrier()
    for _ in range(3 + steps):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    report = gather_report(recorder)
    dist.barrier()  # the companions keep computing until rank 0 is done
    return report


def profile_world1(build: Callable, make_batch: Callable, loss_fn: Callable, *, steps: int = 10,
                   batch_size: int | None = None, path: str | None = None,
                   timeout: float = 300.0, beside: int = 0) -> dict:
    """A world-1 profile measured in a fresh one-thread process (as the ranks will run).

    It is the doctor's profile (``enable_profiling``): at a world of one it lists the buckets
    DDP would send and when each would be ready (:mod:`lockstep.ddp.arrivals`).

    Args:
        beside: processes that train the same model alone at the same time (one thread each),
            so the profile carries what ranks computing side by side do to each other's compute
            (shared caches and memory bandwidth); 0: the machine is otherwise idle.
    """
    import json

    from lockstep.launcher.spawn import spawn

    if beside < 0:
        raise ValueError(f"beside must be >= 0 (companion processes), got {beside}")
    doc = spawn(_profile_worker, 1 + beside, (build, make_batch, loss_fn, steps, batch_size),
                timeout=timeout)[0]
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return doc


def _ddp_worker(rank: int, build: Callable, make_batch: Callable, loss_fn: Callable, steps: int,
                throttle: float | None, sweep_sizes: Sequence[int] | None) -> dict:
    import torch.distributed as dist

    from lockstep.ddp.wrapper import DistributedDataParallel
    from lockstep.distributed import init_distributed
    from lockstep.doctor.recorder import Recorder
    from lockstep.doctor.records import phases_of
    from lockstep.plan.measure import sweep_allreduce

    init_distributed()
    torch.manual_seed(0)
    model = DistributedDataParallel(build())
    if throttle is not None:
        model.register_comm_hook(Throttle(throttle), throttle_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch()
    for _ in range(3):  # warm-up, and the reducer rebuilds its buckets in arrival order
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    # The link as this run finds it: measured by the same processes just before the steps.
    sweep = sweep_allreduce(sweep_sizes, SWEEP_ROUNDS) if sweep_sizes else None
    model.enable_step_timing()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):  # no barrier per step: the all-reduces keep the ranks in step
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    step_s = (time.perf_counter() - start) / steps
    recorder = model.profiler  # the doctor's Recorder (lockstep.profilers)
    recorded = recorder.payload()["steps"] if isinstance(recorder, Recorder) else []
    # Exposed: backward's wait for the all-reduces and forward's wait for the buffer broadcast.
    waits = [phases_of(s)["exposed_comm"] for s in recorded[1:]] or [0.0]
    return {"step_s": step_s, "exposed_s": statistics.median(waits),
            "exposed_backward_s": statistics.median(t.exposed_comm_s for t in model.step_timings),
            "sweep": sweep}


def measure_ddp(build: Callable, make_batch: Callable, loss_fn: Callable, world: int, *,
                steps: int = 10, throttle: float | None = None, timeout: float = 300.0,
                sweep_sizes: Sequence[int] | None = None) -> dict:
    """Step and exposed-communication seconds of lockstep's DDP at ``world`` ranks (the slowest
    rank's; exposed is the median step's, including the wait for the buffer broadcast).

    With ``sweep_sizes``, the same processes first run :func:`~lockstep.plan.measure.sweep_allreduce`
    right before the timed steps; ``"link"`` is then the :class:`~lockstep.plan.measure.LinkSweep`.
    """
    from lockstep.launcher.spawn import spawn
    from lockstep.plan.measure import LinkSweep

    rows = spawn(_ddp_worker, world, (build, make_batch, loss_fn, steps, throttle, sweep_sizes),
                 timeout=timeout)
    out: dict[str, Any] = {k: max(r[k] for r in rows)
                           for k in ("step_s", "exposed_s", "exposed_backward_s")}
    if sweep_sizes:
        out["link"] = LinkSweep.combine([r["sweep"] for r in rows], sweep_sizes)
    return out


def workload_of(profile: dict | str | Workload) -> Workload:
    """The :class:`Workload` of a profile given as a dict, a file path or already read."""
    if isinstance(profile, Workload):
        return profile
    if isinstance(profile, str):
        return load_profile(profile)
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f)
        return load_profile(path)
    finally:
        os.unlink(path)


def predict_ddp(profile: dict | str | Workload, link: Link, world: int,
                cpu_cores: int | None = None, codec_bandwidth: float | None = None) -> Prediction:
    """The planner's DDP prediction at ``world`` ranks all on ``link`` (one machine).

    ``cpu_cores``: the cores the ranks share (:attr:`PlanOptions.cpu_cores`); None: one each.
    ``codec_bandwidth``: the rate of the bucket copies (:attr:`PlanOptions.codec_bandwidth`);
    None: the device's default.
    """
    result = predict(workload_of(profile), Topology(link, world), world, parse_strategy("ddp"),
                     PlanOptions(cpu_cores=cpu_cores, codec_bandwidth=codec_bandwidth))
    assert result is not None  # DDP always runs
    return result


def held_extra(profile: dict | str | Workload, real: Link, throttle: float, world: int,
               codec_bandwidth: float | None = None) -> float:
    """Seconds of exposed communication that :func:`throttle_hook`'s holds add to a DDP step
    on ``real``.

    Without holds, each bucket's copy in, all-reduce and copy back queue on the link, as the
    planner prices them. With holds, a bucket's hold starts when its all-reduce is done and the
    previous bucket's hold is over, and its copy back follows the hold: two queues in a row, the
    real all-reduces of later buckets running during earlier holds (not the two links in
    series, which would count every bucket's real all-reduce on top of every hold).
    """
    if throttle <= 0:
        raise ValueError(f"throttle bandwidth must be positive, got {throttle}")
    workload = workload_of(profile)
    if world <= 1 or not workload.buckets:
        return 0.0
    topo = Topology(real, world)
    ready = [b.ready for b in workload.buckets]
    cost = [collective(ALL_REDUCE, b.nbytes, world, topo).seconds for b in workload.buckets]
    rate = copy_rate(workload, PlanOptions(codec_bandwidth=codec_bandwidth))
    copy = [2 * b.nbytes / rate for b in workload.buckets]
    holds = [2 * (world - 1) / world * b.nbytes / throttle for b in workload.buckets]
    plain = simulate_buckets(ready, cost, copy, copy)[-1][1]
    reduced = [done for _, done in simulate_buckets(ready, cost, copy)]
    held = simulate_buckets(reduced, holds, None, copy)[-1][1]
    end = workload.backward
    return max(0.0, held - end) - max(0.0, plain - end)


def predict_throttled(profile: dict | str | Workload, real: Link, throttle: float, world: int,
                      cpu_cores: int | None = None, codec_bandwidth: float | None = None
                      ) -> tuple[float, float]:
    """(step, exposed) seconds of a run throttled by :func:`throttle_hook` at ``throttle``
    bytes/s: the prediction on the real link plus what the holds add (:func:`held_extra`).

    With ``cpu_cores`` (ranks time-sharing cores) the holds still add the same: they are sleeps
    and take no core, so the time-shared step on the real link stands.
    """
    workload = workload_of(profile)
    base = predict_ddp(workload, real, world, cpu_cores=cpu_cores, codec_bandwidth=codec_bandwidth)
    extra = held_extra(workload, real, throttle, world, codec_bandwidth)
    return base.step_s + extra, base.exposed_comm_s + extra


def predict_throttled_shared(profile: dict | str | Workload, real: Link, throttle: float,
                             world: int, cpu_cores: int, codec_bandwidth: float | None = None
                             ) -> tuple[float, float]:
    """(step, exposed) seconds of a throttled run whose ranks time-share ``cpu_cores`` cores
    (:func:`predict_throttled` with ``cpu_cores``)."""
    return predict_throttled(profile, real, throttle, world, cpu_cores=cpu_cores,
                             codec_bandwidth=codec_bandwidth)
