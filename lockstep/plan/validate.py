"""Check the planner against this machine: profile at world 1, predict world N, run world N.

Used by ``benchmarks/bench_plan.py`` and the tests. ``build``, ``make_batch`` and ``loss_fn`` must
be module-level functions (workers are new processes): ``build() -> nn.Module``,
``make_batch() -> (inputs, targets)``, ``loss_fn(output, targets) -> loss``.

A *throttled* run registers :func:`throttle_hook`, which holds each bucket's all-reduce result
for ``2(n-1)/n * bytes / bandwidth`` seconds on the communication thread: a link of that bus
bandwidth in series with the real one, as a slow network would be.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lockstep.plan.links import Link, Topology
from lockstep.plan.model import PlanOptions, Prediction, predict
from lockstep.plan.strategies import parse_strategy
from lockstep.plan.workload import Workload, load_profile

__all__ = [
    "SWEEP_ROUNDS", "Throttle", "cpu_cores", "measure_ddp", "predict_ddp",
    "predict_throttled_shared", "profile_world1",
    "throttle_hook", "throttled_link",
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


def throttled_link(link: Link, bandwidth: float) -> Link:
    """The measured link with a throttle of ``bandwidth`` bytes/s in series."""
    return Link(f"{link.name}+throttle", link.alpha, 1 / (1 / link.beta + 1 / bandwidth))


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


def predict_ddp(profile: dict | str | Workload, link: Link, world: int,
                cpu_cores: int | None = None) -> Prediction:
    """The planner's DDP prediction at ``world`` ranks all on ``link`` (one machine).

    ``cpu_cores``: the cores the ranks share (:attr:`PlanOptions.cpu_cores`); None: one each.
    """
    if isinstance(profile, Workload):
        workload = profile
    elif isinstance(profile, str):
        workload = load_profile(profile)
    else:
        import json
        import os
        import tempfile

        fd, path = tempfile.mkstemp(suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(profile, f)
            workload = load_profile(path)
        finally:
            os.unlink(path)
    result = predict(workload, Topology(link, world), world, parse_strategy("ddp"),
                     PlanOptions(cpu_cores=cpu_cores))
    assert result is not None  # DDP always runs
    return result


def predict_throttled_shared(profile: dict | str | Workload, real: Link, throttle: float,
                             world: int, cpu_cores: int) -> tuple[float, float]:
    """(step, exposed) seconds of a throttled run whose ranks time-share ``cpu_cores`` cores.

    The throttle's holds are sleeps: they take no core, so the time-shared step on the real
    link (:attr:`PlanOptions.cpu_cores`) stands, and what the holds add is the exposed time
    they add when nothing is time-shared (the plain model with and without the throttle).
    """
    shared = predict_ddp(profile, real, world, cpu_cores=cpu_cores)
    plain = predict_ddp(profile, real, world)
    held = predict_ddp(profile, throttled_link(real, throttle), world)
    extra = max(0.0, held.exposed_comm_s - plain.exposed_comm_s)
    return shared.step_s + extra, shared.exposed_comm_s + extra
