"""The link sweep's fit and spread, and the CPU share of a collective in the shared-cores model."""

from __future__ import annotations

import pytest

from lockstep.plan import (
    Bucket,
    Link,
    LinkSweep,
    PlanOptions,
    Topology,
    Workload,
    fit_alpha_beta,
    parse_strategy,
    predict,
)
from lockstep.plan.measure import DEFAULT_SIZES

ALPHA, BETA = 250e-6, 1e9


def ring(sizes, n: int, alpha: float = ALPHA, beta: float = BETA) -> list[float]:
    return [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta for s in sizes]


def test_sizes_span_ddp_buckets():
    # DDP sends a 1 MB first bucket, then buckets of up to 25 MB.
    assert min(DEFAULT_SIZES) <= 64 << 10 and max(DEFAULT_SIZES) >= 25 << 20


def test_one_slow_large_message_does_not_swallow_alpha():
    sizes = [4e3, 6.4e4, 2.56e5, 1e6, 4e6, 1.6e7, 3.2e7]
    times = ring(sizes, 2)
    times[-1] *= 1.10  # the 32 MB sample 10% slow (a burst of load elsewhere)
    link = fit_alpha_beta(sizes, times, 2)
    # Unweighted least squares gives alpha 143 us here (-43%): the 32 MB residual sets the
    # intercept. On relative error the small messages keep alpha.
    assert link.alpha == pytest.approx(ALPHA, rel=0.05)
    assert link.beta == pytest.approx(BETA, rel=0.05)
    with pytest.raises(ValueError, match="positive"):
        fit_alpha_beta([1, 2], [0.0, 1.0], 2)


def test_sweep_takes_the_slowest_rank_and_reports_the_spread():
    sizes = (10_000, 1_000_000, 10_000_000)
    fast, slow = ring(sizes, 2), ring(sizes, 2, beta=BETA / 2)
    cpu = ring(sizes, 2, alpha=ALPHA / 4, beta=BETA * 2)  # a quarter of alpha, half of beta
    rank0 = {"wall": [fast, slow, fast], "cpu": [cpu, cpu, cpu]}
    rank1 = {"wall": [fast, fast, fast], "cpu": [[2 * x for x in cpu]] * 3}
    sweep = LinkSweep.combine([rank0, rank1], sizes)
    assert sweep.world == 2 and len(sweep.seconds) == 3
    assert sweep.seconds[1] == tuple(slow)  # the slowest rank per round and size
    # Median over rounds: the slow round does not move the link.
    assert sweep.link.alpha == pytest.approx(ALPHA) and sweep.link.beta == pytest.approx(BETA)
    lo, hi = sweep.spread()["beta"]
    assert lo == pytest.approx(BETA / 2) and hi == pytest.approx(BETA)
    # CPU: the ranks' mean (1.5 x cpu): alpha share 1.5/4, bandwidth share 1.5/2.
    assert sweep.link.cpu_share == pytest.approx((1.5 / 4, 1.5 / 2))
    # Per round: the slow round's wall beta is half, so its CPU is half its bandwidth term.
    spread = sweep.spread()
    assert spread["cpu_latency_share"] == pytest.approx((1.5 / 4, 1.5 / 4))
    assert spread["cpu_bandwidth_share"] == pytest.approx((1.5 / 4, 1.5 / 2))
    assert "cpu_latency_share" not in LinkSweep(2, sweep.sizes, sweep.seconds).spread()
    text = sweep.describe()
    assert "single rounds" in text and "0.5-1 GB/s" in text and "CPU work" in text


def test_shared_cores_count_only_the_cpu_share_of_a_collective():
    w = Workload(parameters=1_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, batch_size=8, device="cpu",
                 buckets=(Bucket(4e6, 0.020),))
    opts = PlanOptions(cpu_cores=2, codec_bandwidth=1e30)
    ddp = parse_strategy("ddp")
    link = Link("loopback", 1e-3, 1e9)
    whole = predict(w, Topology(link, 3), 3, ddp, opts)
    part = predict(w, Topology(Link("loopback", 1e-3, 1e9, cpu_share=(0.5, 0.25)), 3), 3, ddp,
                   opts)
    assert whole is not None and part is not None
    latency, bandwidth = 4 * 1e-3, 4 / 3 * 4e6 / 1e9  # ring all-reduce of 4 MB on 3 ranks
    compute = 0.010 + 0.020 + 0.002
    assert whole.step_s == pytest.approx(0.001 + 3 * (compute + latency + bandwidth) / 2)
    assert part.step_s == pytest.approx(0.001 + 3 * (compute + 0.5 * latency + 0.25 * bandwidth) / 2)
    with pytest.raises(ValueError, match="cpu_share"):
        Link("bad", 1e-3, 1e9, cpu_share=(-1.0, 0.5))


def test_a_throttles_holds_queue_behind_the_real_all_reduces():
    """Validation's throttled runs: each bucket's hold starts once its all-reduce is done and
    the previous hold is over (two queues in a row, not two links in series), and on shared
    cores the holds add what they add where nothing is time-shared (sleeps take no core)."""
    from lockstep.plan.validate import (
        held_extra,
        predict_ddp,
        predict_throttled,
        predict_throttled_shared,
    )

    w = Workload(parameters=1_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, batch_size=8, device="cpu",
                 buckets=(Bucket(4e6, 0.010), Bucket(4e6, 0.020)))
    real = Link("loopback", 1e-3, 1e9, cpu_share=(0.5, 0.5))
    # By hand, world 3: a ring all-reduce of 4 MB takes 4 alpha + 4/3 * 4 MB / beta; each copy
    # (into the bucket, back into the gradients) 2 * 4 MB at the CPU's 5 GB/s; each hold
    # 4/3 * 4 MB at 50 MB/s.
    reduce, copy, hold = 4e-3 + 4 / 3 * 4e6 / 1e9, 2 * 4e6 / 5e9, 4 / 3 * 4e6 / 50e6
    done0 = 0.010 + copy + reduce  # bucket 0's all-reduce; bucket 1's starts after its copy
    done1 = max(0.020 + copy, done0) + reduce
    held_end = max(done1, done0 + hold + copy) + hold + copy
    plain_end = max(0.020 + copy, done0 + copy) + reduce + copy
    extra = (held_end - 0.020) - (plain_end - 0.020)
    assert held_extra(w, real, 50e6, 3) == pytest.approx(extra)
    assert extra > 0.2  # 8 MB through 50 MB/s: the holds dominate
    # Less than the holds and every real all-reduce in series would add.
    assert extra < 2 * (hold + reduce + copy)
    assert held_extra(w, real, 50e6, 1) == 0.0
    plain = predict_ddp(w, real, 3)
    assert predict_throttled(w, real, 50e6, 3) == pytest.approx(
        (plain.step_s + extra, plain.exposed_comm_s + extra))
    shared = predict_ddp(w, real, 3, cpu_cores=2)
    step, exposed = predict_throttled_shared(w, real, 50e6, 3, 2)
    assert (step, exposed) == pytest.approx((shared.step_s + extra, shared.exposed_comm_s + extra))
    with pytest.raises(ValueError, match="throttle bandwidth"):
        held_extra(w, real, 0, 3)


def test_copy_rate_is_measured_and_prices_the_bucket_copies():
    """A plain copy's rate (read and write counted) is the fastest DDP's bucket copies can go:
    the validation's intervals price them at it on their low end."""
    from lockstep.plan.measure import measure_copy_rate
    from lockstep.plan.validate import predict_ddp, predict_throttled

    rate = measure_copy_rate(1 << 20, repeats=3)
    assert rate > 0
    with pytest.raises(ValueError, match="at least 4 bytes"):
        measure_copy_rate(0)
    w = Workload(parameters=1_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, batch_size=8, device="cpu",
                 buckets=(Bucket(4e6, 0.010), Bucket(4e6, 0.020)))
    real = Link("loopback", 1e-3, 1e9, cpu_share=(0.5, 0.5))
    default = predict_ddp(w, real, 3, cpu_cores=2)
    fast = predict_ddp(w, real, 3, cpu_cores=2, codec_bandwidth=1e12)
    # Four copies of 4 MB each way (two buckets, in and back) at 5 GB/s: 6.4 ms per rank,
    # time-shared by 3 ranks on 2 cores.
    assert default.step_s - fast.step_s == pytest.approx(3 * (4 * 2 * 4e6 / 5e9 - 4 * 2 * 4e6 / 1e12) / 2)
    held = predict_throttled(w, real, 50e6, 3, cpu_cores=2, codec_bandwidth=1e12)
    assert held[0] < predict_throttled(w, real, 50e6, 3, cpu_cores=2)[0]


def test_a_measured_copy_rate_is_the_optimistic_end_of_a_cpu_plan():
    from lockstep.plan.intervals import predict_interval
    from lockstep.plan.links import Topology
    from lockstep.plan.model import PlanOptions, predict
    from lockstep.plan.planner import plan
    from lockstep.plan.strategies import parse_strategy

    w = Workload(parameters=1_000_000, grad_dtype="float32", forward=0.010, backward=0.020,
                 optimizer=0.002, data=0.001, batch_size=8, device="cpu",
                 buckets=(Bucket(4e6, 0.010), Bucket(4e6, 0.020)))
    topo = Topology(Link("loopback", 1e-3, 1e9, cpu_share=(0.5, 0.5)), 3)
    ddp = parse_strategy("ddp")
    plain = predict_interval(w, topo, 3, ddp, PlanOptions(cpu_cores=2))
    measured = predict_interval(w, topo, 3, ddp, PlanOptions(cpu_cores=2, copy_rate=1e12))
    assert plain is not None and measured is not None
    # Only the optimistic end moves: four 8 MB copies per rank at 1 TB/s instead of 5 GB/s,
    # three ranks time-sharing two cores.
    assert plain.step_low_s - measured.step_low_s == pytest.approx(
        3 * 4 * 8e6 * (1 / 5e9 - 1 / 1e12) / 2)
    assert measured.step_high_s == plain.step_high_s
    assert measured.expected.step_s == plain.expected.step_s
    # A GPU profile keeps its own rate; a rate must be positive.
    gpu = replace_device(w, "cuda")
    same = [predict(gpu, topo, 3, ddp, PlanOptions(bound="optimistic", copy_rate=r)) for r in (None, 1e3)]
    assert same[0].step_s == same[1].step_s
    with pytest.raises(ValueError, match="copy_rate must be > 0"):
        PlanOptions(copy_rate=0)
    text = " ".join(plan(w, topo, [3], "ddp", PlanOptions(cpu_cores=2, copy_rate=3.2e10)).assumptions)
    assert "bucket copies priced at 5 GB/s" in text and "32.0 GB/s" in text


def replace_device(workload: Workload, device: str) -> Workload:
    from dataclasses import replace

    return replace(workload, device=device)
