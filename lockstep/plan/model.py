"""Step time, overlap and memory of one strategy at one GPU count: the planner's core.

A step is ``data + forward + backward + exposed communication + optimizer``, plus what is sent
outside backward and never hidden (the buffer broadcast before forward, ZeRO's parameter
all-gather, local SGD's average). Each gradient bucket
is sent on one link queue in launch order: it starts at ``max(ready, previous bucket done)`` (plus
its encode time when compressed) and takes the collective's alpha-beta cost (plus decode). What
is still running when backward's compute ends is *exposed*. The bucket that becomes ready last
(the first layers, whose gradients come out at the very end of backward) can never hide: its whole
all-reduce is exposed however fast the rest is -- the first-bucket effect. See docs/plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lockstep.plan.costs import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    REDUCE_SCATTER,
    Cost,
    point_to_point,
)
from lockstep.plan.costs import collective as _plain_collective
from lockstep.plan.links import Topology
from lockstep.plan.memory import Memory, model_state_memory
from lockstep.plan.stragglers import DEFAULT_CV, straggler_delay
from lockstep.plan.strategies import Strategy
from lockstep.plan.transports import BOUNDS, Transport, achievable
from lockstep.plan.workload import DTYPE_BYTES, Workload

__all__ = ["PlanOptions", "Prediction", "buffer_broadcast", "codec_bandwidth", "collective", "predict",
           "simulate_buckets"]


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the model that a profile does not carry.

    Args:
        optimizer: ``adam``, ``sgd-momentum`` or ``sgd`` (optimizer-state bytes per parameter).
        mixed_precision: 2-byte parameters and gradients with fp32 master state; ``None``
            decides from the gradient dtype.
        gpu_memory: bytes per GPU; strategies whose model states exceed it are marked "no fit".
        codec_bandwidth: bytes/s at which a GPU casts gradients for compression (read + write);
            ``None``: 2 TB/s on CUDA (about 60% of an H100's HBM3), 5 GB/s on CPU.
        cpu_cores: for a CPU profile, the cores of one node. Each CPU rank computes on one
            thread and its communication (gloo's copies, sums and loopback sends) is CPU work
            too: when a node has more ranks than cores, they time-share them, so the step is
            at least ``ranks_per_node * (compute + CPU work of the collectives + bucket
            copies) / cpu_cores`` and communication hides behind nothing. With a core per
            rank the ordinary overlap model stands (measured closer there: docs/plan.md). A collective's CPU work is its latency and bandwidth terms scaled by the
            link's measured ``cpu_share`` (all of it when unknown). ``None``: cores are not
            counted (a device per rank, as with GPUs). Ignored for GPU profiles.
        bound: ``None`` keeps the line-rate lower bound (links at their stated bandwidth, no
            stragglers). ``"optimistic"``, ``"expected"`` or ``"pessimistic"`` price preset links
            at their transport's achievable bandwidth plus a per-message cost
            (:mod:`lockstep.plan.transports`) and add the wait for the slowest of N ranks
            (:mod:`lockstep.plan.stragglers`), each input taken at that end of its range.
        step_cv: spread (std / mean) of one rank's compute time; ``None``: the workload's own
            (from the profile's per-rank phases) or :data:`~lockstep.plan.stragglers.DEFAULT_CV`
            at ``bound``. Used only when ``bound`` is set.
        transports: the transport table (default :data:`~lockstep.plan.transports.TRANSPORTS`).
        default_cv: the (low, expected, high) spread used when neither ``step_cv`` nor the
            workload carries one (default :data:`~lockstep.plan.stragglers.DEFAULT_CV`);
            benchmarks/bench_plan_scaling.py rebuilds it from published rows.
        copy_rate: bytes/s of a plain copy on the ranks' device, read and write counted
            (:func:`~lockstep.plan.measure.measure_copy_rate`; ``lockstep plan --measure-link``
            measures it for a CPU profile). DDP's bucket copies go no faster, so for a CPU
            profile at ``bound="optimistic"`` they are priced at the faster of it and the default
            5 GB/s (which stands for all of a bucket's per-byte CPU work: docs/plan.md), so that
            end is never slower than the point. ``None``: not measured.
    """

    optimizer: str = "adam"
    mixed_precision: bool | None = None
    gpu_memory: float | None = None
    codec_bandwidth: float | None = None
    cpu_cores: int | None = None
    bound: str | None = None
    step_cv: float | None = None
    transports: Mapping[str, Transport] | None = None
    default_cv: tuple[float, float, float] = DEFAULT_CV
    copy_rate: float | None = None

    def __post_init__(self) -> None:
        if self.bound is not None and self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {', '.join(BOUNDS)} or None, got {self.bound!r}")
        if self.step_cv is not None and self.step_cv < 0:
            raise ValueError(f"step_cv must be >= 0, got {self.step_cv}")
        lo, mid, hi = self.default_cv
        if not 0 <= lo <= mid <= hi:
            raise ValueError(f"default_cv must be 0 <= low <= expected <= high, got "
                             f"{self.default_cv}")
        for name in ("codec_bandwidth", "copy_rate"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 bytes/s, got {value}")
        if self.cpu_cores is not None and self.cpu_cores < 1:
            raise ValueError(f"cpu_cores must be >= 1 (the cores of one node), got {self.cpu_cores}")


@dataclass(frozen=True)
class Prediction:
    """One strategy at one GPU count."""

    strategy: str
    gpus: int
    nodes: int
    step_s: float
    samples_per_s: float
    efficiency: float
    exposed_comm_s: float
    comm_s: float
    memory: Memory
    binding: str
    algorithm: str
    fits: bool = True
    exact: bool = True
    best: bool = False
    detail: dict = field(default_factory=dict)

    @property
    def exposed_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0


def collective(kind: str, nbytes: float, world: int, topo: Topology,
               per_message: float = 0.0) -> Cost:
    """:func:`lockstep.plan.costs.collective` plus a fixed cost per message (its latency term).

    With a per-message cost (a transport-aware prediction) only NCCL's own algorithms, ring and
    tree, are candidates: NCCL has no hierarchical all-reduce (docs/plan.md, "published").
    """
    c = _plain_collective(kind, nbytes, world, topo, hierarchical=per_message <= 0)
    if per_message <= 0 or c.seconds <= 0:
        return c
    return Cost(c.seconds + per_message, c.latency_s + per_message, c.bandwidth_s, c.algorithm,
                c.bound_by)


def simulate_buckets(ready: list[float], cost: list[float], encode: list[float] | None = None,
                     decode: list[float] | None = None) -> list[tuple[float, float]]:
    """(start, done) of each bucket on one link queue, in launch order.

    A bucket starts when it is ready (and encoded) and the previous one is done.
    """
    encode = encode or [0.0] * len(ready)
    decode = decode or [0.0] * len(ready)
    out, done = [], 0.0
    for r, c, e, d in zip(ready, cost, encode, decode):
        start = max(r + e, done)
        done = start + c + d
        out.append((start, done))
    return out


def codec_bandwidth(workload: Workload, options: PlanOptions) -> float:
    """Bytes/s of a bucket's copies (into the flat bucket and back): ``options``' own rate, else
    the device's default; for a CPU profile at the optimistic bound, the faster of the default and
    the measured ``copy_rate``.

    The optimistic end must never be slower than the point: a copy measured below the 5 GB/s
    default (a busy machine) leaves that end at the default (until 2026-11-29 it was used as
    measured, and the "optimistic" step came out slower than the expected one).
    """
    if options.codec_bandwidth is not None:
        return options.codec_bandwidth
    default = 2e12 if workload.device == "cuda" else 5e9
    if options.bound == "optimistic" and options.copy_rate is not None and workload.device == "cpu":
        return max(options.copy_rate, default)
    return default


def _backward_comm(workload: Workload, topo: Topology, world: int, strategy: Strategy,
                   options: PlanOptions, pm: float = 0.0
                   ) -> tuple[float, float, list[Cost], float, float]:
    """(exposed seconds after backward, link seconds, the costs, last bucket's cost, copy seconds).

    Every bucket is copied twice besides its collective: the gradients into the flat bucket
    (cast to the wire dtype when compressed) and the result back into the gradients, each a
    read and a write at ``codec_bandwidth`` (negligible on a GPU, not on a CPU).
    """
    buckets = workload.buckets  # launch order: a bucket waits for the one before it
    if strategy.averages_parameters or strategy.data_parallel or world <= 1:
        return 0.0, 0.0, [], 0.0, 0.0
    costs: list[Cost] = []
    encode: list[float] = []
    rate = codec_bandwidth(workload, options)
    priced: dict[float, Cost] = {}  # buckets of one size cost the same: a big model has 1e5
    for b in buckets:
        sent = b.nbytes * strategy.ratio
        c = priced.get(sent)
        if c is None:
            c = priced[sent] = _bucket_cost(sent, world, topo, strategy, pm)
        costs.append(c)
        encode.append((b.nbytes + sent) / rate)
    schedule = simulate_buckets([b.ready for b in buckets], [c.seconds for c in costs],
                                encode, encode)
    done = schedule[-1][1] if schedule else 0.0
    exposed = max(0.0, done - workload.backward)
    return (exposed, sum(c.seconds for c in costs), costs, costs[-1].seconds if costs else 0.0,
            2 * sum(encode))


def _bucket_cost(sent: float, world: int, topo: Topology, strategy: Strategy, pm: float) -> Cost:
    """One bucket's collective(s) in backward: an all-reduce, or ZeRO's reduce-scatter."""
    if strategy.zero_stage < 2:
        return collective(ALL_REDUCE, sent, world, topo, pm)
    c = collective(REDUCE_SCATTER, sent, world, topo, pm)
    if strategy.zero_stage == 3:  # the parameters are gathered again for backward
        g = collective(ALL_GATHER, sent, world, topo, pm)
        c = Cost(c.seconds + g.seconds, c.latency_s + g.latency_s,
                 c.bandwidth_s + g.bandwidth_s, c.algorithm, c.bound_by)
    return c


def _zero3_forward(workload: Workload, topo: Topology, world: int, pm: float = 0.0) -> float:
    """Forward with parameters gathered chunk by chunk, prefetched on one link queue."""
    chunks = sorted(workload.buckets, key=lambda b: -b.ready)  # forward order: first layers first
    total = sum(b.nbytes for b in chunks) or 1.0
    compute_done = link_done = 0.0
    priced: dict[float, float] = {}
    for b in chunks:
        if b.nbytes not in priced:
            priced[b.nbytes] = collective(ALL_GATHER, b.nbytes, world, topo, pm).seconds
        link_done += priced[b.nbytes]
        compute_done = max(compute_done, link_done) + workload.forward * b.nbytes / total
    return compute_done


def predict(workload: Workload, topo: Topology, world: int, strategy: Strategy,
            options: PlanOptions | None = None) -> Prediction | None:
    """The predicted step of ``strategy`` on ``world`` GPUs, or ``None`` where it cannot run
    (DataParallel across nodes)."""
    options = options or PlanOptions()
    if world < 1:
        raise ValueError(f"GPU count must be >= 1, got {world}")
    if strategy.data_parallel and world > topo.gpus_per_node:
        return None
    per_node = min(topo.gpus_per_node, world)
    nodes = math.ceil(world / per_node)
    mixed = options.mixed_precision
    if mixed is None:
        mixed = DTYPE_BYTES[workload.grad_dtype] <= 2
    width = 2 if mixed else 4
    param_bytes = workload.parameters * width
    pm = 0.0
    if options.bound is not None:
        topo, pm = achievable(topo, options.bound, options.transports)
    exposed, link_s, costs, last, copies = _backward_comm(workload, topo, world, strategy, options,
                                                          pm)
    forward = workload.forward
    optimizer = workload.optimizer / (world if strategy.zero_stage >= 1 else 1)
    buffers = (buffer_broadcast(workload, topo, world, pm) if strategy.broadcasts_buffers
               else Cost.zero())
    outside = [buffers]  # communication outside backward, never hidden
    if strategy.zero_stage == 3 and world > 1:
        forward = _zero3_forward(workload, topo, world, pm)
    elif strategy.zero_stage in (1, 2) and world > 1:
        outside.append(collective(ALL_GATHER, param_bytes, world, topo, pm))
    if strategy.averages_parameters and world > 1:
        # Local SGD / DiLoCo: one all-reduce of the fp32 parameters (or of the change) every H.
        c = collective(ALL_REDUCE, workload.parameters * 4, world, topo, pm)
        h = strategy.sync_every
        outside.append(Cost(c.seconds / h, c.latency_s / h, c.bandwidth_s / h, c.algorithm,
                            c.bound_by))
        if strategy.outer_optimizer:
            optimizer += workload.optimizer / strategy.sync_every
    if strategy.data_parallel and world > 1:
        outside.append(_replicate_and_reduce(workload, topo, world, param_bytes))
    outside = [c for c in outside if c.seconds > 0]
    extra = sum(c.seconds for c in outside)
    link_s += extra
    exposed_total = exposed + extra + (forward - workload.forward)
    # The wait for the slowest rank is its own column (detail["straggler_s"]), not
    # communication: "exposed" is the communication nothing hid.
    wait = _straggler_wait(workload, world, options)
    step = (workload.data + forward + workload.backward + exposed + optimizer + extra
            + workload.other + wait)
    shared = _shared_cores(workload, options, per_node, step - exposed_total - wait - workload.data,
                           _cpu_work(costs + outside, topo) + copies)
    if shared is not None and shared > step:
        exposed_total += shared - step
        step = shared
    batch = workload.batch_size or 1
    memory = model_state_memory(workload.parameters, world,
                                strategy.zero_stage, mixed_precision=mixed,
                                optimizer=options.optimizer)
    fits = options.gpu_memory is None or memory.total <= options.gpu_memory
    all_costs = costs + outside
    binding = _binding(workload, step, exposed_total, all_costs, fits)
    if fits and step > 0 and wait / step >= 0.1 and wait > exposed_total:
        binding = f"the slowest of {world} ranks"
    if shared is not None and shared >= step and fits:
        binding = f"cpu cores ({per_node} ranks on {options.cpu_cores})"
    if shared is not None and shared >= step:
        wait = 0.0  # the core-seconds bound replaced the step: no wait for the slowest rank is in it
    algorithm = max(all_costs, key=lambda c: c.seconds).algorithm if all_costs else "none"
    return Prediction(
        strategy=strategy.name, gpus=world, nodes=nodes, step_s=step,
        samples_per_s=world * batch / step, efficiency=workload.compute / step,
        exposed_comm_s=exposed_total, comm_s=link_s, memory=memory, binding=binding,
        algorithm=algorithm, fits=fits, exact=strategy.exact,
        detail={"forward_s": forward, "backward_s": workload.backward, "optimizer_s": optimizer,
                "data_s": workload.data, "other_s": workload.other, "exposed_after_backward_s": exposed,
                "outside_backward_s": extra, "last_bucket_s": last,
                "buffer_broadcast_s": buffers.seconds, "straggler_s": wait,
                "per_message_s": pm},
    )


def _straggler_wait(workload: Workload, world: int, options: PlanOptions) -> float:
    """The wait for the slowest of ``world`` ranks (0 without ``options.bound``)."""
    if options.bound is None or world <= 1:
        return 0.0
    cv = options.step_cv
    if cv is None:
        cv = workload.step_cv if workload.step_cv is not None else (
            options.default_cv[BOUNDS.index(options.bound)])
    return straggler_delay(workload.compute, world, cv)


def buffer_broadcast(workload: Workload, topo: Topology, world: int,
                     pm: float = 0.0) -> Cost:
    """DDP's broadcast of rank 0's buffers before every forward: one collective per message.

    Every rank waits for it before its forward starts, so nothing hides it.
    """
    total = Cost.zero()
    for nbytes in workload.buffer_broadcasts:
        c = collective(BROADCAST, nbytes, world, topo, pm)
        if c.seconds > 0:
            total = Cost(total.seconds + c.seconds, total.latency_s + c.latency_s,
                         total.bandwidth_s + c.bandwidth_s, f"{c.algorithm} bcast", c.bound_by)
    return total


def _replicate_and_reduce(workload: Workload, topo: Topology, world: int,
                          param_bytes: float) -> Cost:
    """DataParallel: parameters and buffers copied from device 0 before forward, gradients
    reduced onto it after backward, each a chain of point-to-point copies."""
    chain = (world - 1) * topo.intra.alpha
    out = point_to_point(param_bytes + sum(workload.buffer_broadcasts), topo.intra)
    back = point_to_point(param_bytes, topo.intra)
    return Cost(out.seconds + back.seconds + 2 * chain, out.latency_s + back.latency_s + 2 * chain,
                out.bandwidth_s + back.bandwidth_s, "bcast+reduce", "intra")


def _cpu_work(costs: list[Cost], topo: Topology) -> float:
    """Seconds of a rank's CPU that ``costs`` take: each term times its link's ``cpu_share``."""
    total = 0.0
    for c in costs:
        link = topo.across() if c.bound_by == "inter" else topo.intra
        latency, bandwidth = link.cpu_share if link.cpu_share is not None else (1.0, 1.0)
        total += c.latency_s * latency + c.bandwidth_s * bandwidth
    return total


def _shared_cores(workload: Workload, options: PlanOptions, ranks: int, compute: float,
                  cpu_comm: float) -> float | None:
    """The step when a CPU node's ranks time-share its cores (``PlanOptions.cpu_cores``), or None
    where there is a core per rank.

    ``compute`` is a rank's CPU work besides data loading and communication; ``cpu_comm`` the
    CPU work of its collectives and bucket copies. ``ranks`` ranks need
    ``ranks * (compute + cpu_comm)`` core-seconds per step from ``cpu_cores`` cores.
    """
    if options.cpu_cores is None or workload.device != "cpu" or ranks <= options.cpu_cores:
        return None
    return workload.data + ranks * (compute + cpu_comm) / options.cpu_cores


def _binding(workload: Workload, step: float, exposed: float, costs: list[Cost], fits: bool) -> str:
    """The resource that bounds the step: memory, a link (latency or bandwidth), data or compute."""
    if not fits:
        return "memory"
    if step > 0 and exposed / step >= 0.1 and costs:
        latency = sum(c.latency_s for c in costs)
        bandwidth = sum(c.bandwidth_s for c in costs)
        inter = sum(c.seconds for c in costs if c.bound_by == "inter")
        level = "inter-node" if inter >= 0.5 * sum(c.seconds for c in costs) else "intra-node"
        return f"{level} {'latency' if latency > bandwidth else 'bandwidth'}"
    if workload.data >= max(workload.forward, workload.backward):
        return "data loading"
    return "compute"
