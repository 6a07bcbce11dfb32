"""The planner against this machine: predicted vs measured DDP step time at worlds 2 and 3.

Usage::

    python benchmarks/bench_plan.py                      # CPU, gloo, worlds 2 and 3, all models
    python benchmarks/bench_plan.py --models mlp --worlds 2 --throttle 50

For each model (the DDP benchmark's): profile one step at world 1 in a fresh one-thread process,
then run lockstep's DDP at each world size; the same processes measure the all-reduce alpha/beta
(``lockstep plan --measure-link``'s sweep) right before their timed steps, so each prediction
uses the link its run found. Predicted and measured are printed side by side, with the link
(alpha, beta, and the range of beta over the sweep's rounds) and the predicted buffer broadcast.
The last prediction uses a world-1 profile taken while ``min(world, cores) - 1`` other processes
train the same model beside it (``profile_world1(beside=...)``): ranks computing side by side
slow each other's compute, which a profile of a lone process does not show.
``--throttle MB/s`` adds a run whose comm hook holds each bucket as a link of that bus bandwidth
would, and compares predicted with measured exposed communication (which includes forward's
wait for the buffer broadcast).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ddp

from lockstep.plan.measure import DEFAULT_SIZES, measure_copy_rate
from lockstep.plan.validate import (
    cpu_cores,
    measure_ddp,
    predict_ddp,
    predict_throttled,
    predict_throttled_shared,
    profile_world1,
)

BATCH = 32


def build_mlp() -> torch.nn.Module:
    return bench_ddp.MODELS["mlp"][0]()


def build_transformer() -> torch.nn.Module:
    return bench_ddp.MODELS["transformer"][0]()


def build_convnet() -> torch.nn.Module:
    return bench_ddp.MODELS["convnet"][0]()


def batch_vector() -> tuple:
    return bench_ddp.make_batch("vector", BATCH, torch.device("cpu"))


def batch_tokens() -> tuple:
    return bench_ddp.make_batch("tokens", BATCH, torch.device("cpu"))


def batch_image() -> tuple:
    return bench_ddp.make_batch("image", BATCH, torch.device("cpu"))


def loss_vector(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return bench_ddp.loss_of("vector", out, y)


def loss_tokens(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return bench_ddp.loss_of("tokens", out, y)


def loss_image(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return bench_ddp.loss_of("image", out, y)


CASES = {
    "mlp": (build_mlp, batch_vector, loss_vector),
    "transformer": (build_transformer, batch_tokens, loss_tokens),
    "convnet": (build_convnet, batch_image, loss_image),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=sorted(CASES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--throttle", type=float, default=None, metavar="MB/s",
                        help="also run with a comm hook throttling to this bus bandwidth")
    parser.add_argument("--save", default=None, metavar="FILE.json",
                        help="also write each row's inputs (profiles, link sweep) and "
                             "measurements, to re-predict them later")
    args = parser.parse_args()
    saved: list[dict] = []

    cores = cpu_cores()
    copy_rate = measure_copy_rate()
    print(f"{cores} cores; 'shared cores' predicts with PlanOptions(cpu_cores={cores}). The link "
          "of each row is measured by its run's own ranks just before the timed steps. A plain "
          f"copy of 32 MiB moves {copy_rate / 1e9:.1f} GB/s (read + write; the intervals' low end "
          "prices DDP's bucket copies at it).")
    print("\n| model | world | link | alpha us | beta GB/s (rounds) | measured step ms "
          "| predicted ms | error | predicted, shared cores | error | shared cores, co-run profile "
          "| error | predicted buffer bcast ms | measured exposed ms | predicted exposed ms "
          "(plain / shared cores) | interval ms | covers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        build, batch, loss = CASES[name]
        doctor = profile_world1(build, batch, loss, steps=args.steps, batch_size=BATCH)
        co_run = {n: profile_world1(build, batch, loss, steps=args.steps, batch_size=BATCH,
                                    beside=n)
                  for n in sorted({min(w, cores) - 1 for w in args.worlds}) if n > 0}
        for world in args.worlds:
            variants = [("measured", None)]
            if args.throttle:
                variants.append((f"throttled {args.throttle:g} MB/s", args.throttle * 1e6))
            for label, throttle in variants:
                got = measure_ddp(build, batch, loss, world, steps=args.steps, throttle=throttle,
                                  sweep_sizes=DEFAULT_SIZES)
                sweep = got["link"]
                real = sweep.link
                pred = predict_ddp(doctor, real, world)
                pred_step, pred_exposed = pred.step_s, pred.exposed_comm_s
                if throttle is not None:  # the holds queue behind the real all-reduces
                    pred_step, pred_exposed = predict_throttled(doctor, real, throttle, world)
                if throttle is None:
                    p = predict_ddp(doctor, real, world, cpu_cores=cores)
                    shared_step, shared_exposed = p.step_s, p.exposed_comm_s
                else:  # the throttle's holds are sleeps, not CPU work (see the function)
                    shared_step, shared_exposed = predict_throttled_shared(
                        doctor, real, throttle, world, cores)
                beside = co_run.get(min(world, cores) - 1, doctor)
                co_step = (predict_ddp(beside, real, world, cpu_cores=cores).step_s
                           if throttle is None else
                           predict_throttled_shared(beside, real, throttle, world, cores)[0])
                ms = got["step_s"]
                spread = sweep.spread()
                lo, hi = spread["beta"]
                interval = cpu_interval(doctor, beside, real, throttle, world, cores, spread,
                                        copy_rate)
                saved.append({"model": name, "world": world, "throttle": throttle, "cores": cores,
                              "copy_rate": copy_rate,
                              "measured": {k: v for k, v in got.items() if k != "link"},
                              "sweep": dataclasses.asdict(sweep), "doctor": doctor,
                              "beside": beside})
                print(f"| {name} | {world} | {label} | {real.alpha * 1e6:.0f} "
                      f"| {real.beta / 1e9:.2f} ({lo / 1e9:.2f}-{hi / 1e9:.2f}) | {ms * 1e3:.1f} "
                      f"| {pred_step * 1e3:.1f} | {(pred_step / ms - 1) * 100:+.0f}% "
                      f"| {shared_step * 1e3:.1f} | {(shared_step / ms - 1) * 100:+.0f}% "
                      f"| {co_step * 1e3:.1f} | {(co_step / ms - 1) * 100:+.0f}% "
                      f"| {pred.detail['buffer_broadcast_s'] * 1e3:.2f} "
                      f"| {got['exposed_s'] * 1e3:.1f} | {pred_exposed * 1e3:.1f} / "
                      f"{shared_exposed * 1e3:.1f} "
                      f"| {interval[0] * 1e3:.1f}-{interval[1] * 1e3:.1f} "
                      f"| {'yes' if interval[0] <= ms <= interval[1] else 'NO'} |", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(saved))


def cpu_interval(doctor, beside, real, throttle, world: int, cores: int,
                 spread: dict[str, tuple[float, float]], copy_rate: float | None = None
                 ) -> tuple[float, float]:
    """(low, high) step seconds of the shared-cores prediction over its inputs' ranges: the
    link's beta and the CPU share of its all-reduces over the sweep's rounds (``spread``:
    ``LinkSweep.spread()``), the profile's compute (alone vs beside co-runners), the rate of
    DDP's bucket copies (``copy_rate``, a plain copy measured on this machine, at the low end;
    the CPU default at the high end), and the wait for the slowest rank
    (stragglers.DEFAULT_CV's high end; the profiles have one rank, so no measured spread)."""
    from dataclasses import replace

    from lockstep.plan.stragglers import DEFAULT_CV, straggler_delay

    def link_at(end: int):
        beta = spread["beta"][1 - end]  # the low end of the step has the fastest link
        shares = [spread.get(k) for k in ("cpu_latency_share", "cpu_bandwidth_share")]
        if real.cpu_share is None or None in shares:
            return replace(real, beta=beta)
        return replace(real, beta=beta, cpu_share=(shares[0][end], shares[1][end]))

    def step(profile, end: int) -> tuple[float, float]:
        link = link_at(end)
        rate = copy_rate if end == 0 else None
        p = predict_ddp(profile, link, world)
        compute = p.detail["forward_s"] + p.detail["backward_s"] + p.detail["optimizer_s"]
        if throttle is None:
            return predict_ddp(profile, link, world, cpu_cores=cores,
                               codec_bandwidth=rate).step_s, compute
        return predict_throttled_shared(profile, link, throttle, world, cores,
                                        codec_bandwidth=rate)[0], compute

    fast = [step(p, 0)[0] for p in (doctor, beside)]
    slow = [step(p, 1) for p in (doctor, beside)]
    high = max(s + straggler_delay(c, world, DEFAULT_CV[2]) for s, c in slow)
    return min(fast), high


if __name__ == "__main__":
    main()
