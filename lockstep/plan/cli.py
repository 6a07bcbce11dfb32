"""``lockstep plan``: predict step time and scaling efficiency before renting the GPUs.

Examples::

    lockstep plan profile.json --gpus 8,64,512,4096 --link nvlink4:8,ib-ndr400 --png plan.png
    lockstep plan --params 1.3B --step-time 0.45 --batch-size 8 --dtype bf16 --link nvlink3:8,ib-hdr200
    lockstep plan profile.json --measure-link --nproc 2 --gpus 2,3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["add_plan_arguments", "parse_count", "run_plan"]

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``125M`` -> 125e6, ``1.3B`` -> 1.3e9, ``7e9`` -> 7e9."""
    t = text.strip().lower()
    scale = _SUFFIX.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if t[-1:] in _SUFFIX else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 125M or 1.3e9") from None


def _number(kind: str, least: float, strict: bool, integer: bool = False) -> Any:
    """An argparse type: a finite number above ``least`` (``strict``) or at least it."""
    def parse(text: str) -> float:
        try:
            value = float(parse_count(text)) if not integer else int(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}")
        return value
    return parse


_POSITIVE = _number("a positive finite number", 0.0, strict=True)
_NON_NEGATIVE = _number("a finite number >= 0", 0.0, strict=False)
_POSITIVE_INT = _number("a positive integer", 0, strict=True, integer=True)


def _gpus(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give integers like 8,64,512") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give positive integers like 8,64,512")
    return values


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", nargs="?", help="profile.json written by lockstep doctor")
    parser.add_argument("--gpus", type=_gpus, default=[8, 64, 512, 4096],
                        help="GPU counts to predict, comma-separated (default 8,64,512,4096)")
    parser.add_argument("--link", default=None,
                        help="INTRA[:GPUS_PER_NODE][,INTER[xNICS]], presets or ALPHA@BW, e.g. "
                        "nvlink4:8,ib-ndr400 (default), pcie4:4,roce25x1, measured:8,eth100")
    parser.add_argument("--link-efficiency", type=float, default=None,
                        help="share of the line rate the collectives achieve (0 < E <= 1); given "
                        "(1.0 included), it replaces the transports' achievable-bandwidth ranges "
                        "(and the intervals)")
    parser.add_argument("--no-intervals", action="store_true",
                        help="the line-rate lower bound only (no transport efficiency, no wait "
                        "for the slowest rank, no ranges)")
    parser.add_argument("--measure-link", action="store_true",
                        help="measure this machine's all-reduce alpha/beta first (name: measured)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for --measure-link (default 2)")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated: ddp, ddp-bf16, ddp-fp16, compress:R, zero1, zero2, "
                        "zero3, localsgd:H, diloco:H, dp (default: all but compress and diloco)")
    parser.add_argument("--batch-size", type=_POSITIVE_INT, default=None,
                        help="per-GPU batch to predict for (compute rescaled from the profile's)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd-momentum", "sgd"])
    parser.add_argument("--precision", default="auto", choices=["auto", "mixed", "fp32"],
                        help="model-state precision for memory (auto: from the gradient dtype)")
    parser.add_argument("--gpu-memory", type=_POSITIVE, default=None, help="GB per GPU")
    parser.add_argument("--cpu-cores", type=int, default=None, metavar="N",
                        help="CPU profiles: cores per node, which the ranks and their "
                             "communication time-share (default: a core per rank)")
    what_if = parser.add_argument_group("what-if, without a profile")
    what_if.add_argument("--params", type=_POSITIVE, help="parameter count, e.g. 125M, 1.3B")
    what_if.add_argument("--step-time", type=_POSITIVE, help="measured forward+backward seconds")
    what_if.add_argument("--flops-per-sample", type=_POSITIVE, help="training flops per sample")
    what_if.add_argument("--gpu-tflops", type=_POSITIVE, help="peak TFLOP/s of one GPU")
    what_if.add_argument("--mfu", type=float, default=None, help="share of peak reached (0.4)")
    what_if.add_argument("--dtype", default=None, help="gradient dtype (bfloat16)")
    what_if.add_argument("--optimizer-time", type=_NON_NEGATIVE, default=None, help="seconds per step")
    what_if.add_argument("--buffer-bytes", type=parse_count, default=None,
                         help="bytes of module buffers (BatchNorm statistics) DDP broadcasts "
                         "before every forward, e.g. 40k (default 0)")
    what_if.add_argument("--input-params", type=parse_count, default=None,
                         help="parameters of the input layer (a transformer's embeddings, e.g. "
                         "23.8M for BERT-base): their gradient is ready only when backward "
                         "ends, so their all-reduce is priced as never hidden (default 0)")
    parser.add_argument("--json", dest="json_path", help="write the plan as JSON here ('-': stdout)")
    parser.add_argument("--png", dest="png_path", help="write the efficiency plot here")


def _workload(args: argparse.Namespace):  # -> Workload
    from lockstep.plan.workload import describe, load_profile

    what_if = {"--params": args.params, "--step-time": args.step_time,
               "--flops-per-sample": args.flops_per_sample, "--gpu-tflops": args.gpu_tflops,
               "--mfu": args.mfu, "--dtype": args.dtype, "--optimizer-time": args.optimizer_time,
               "--buffer-bytes": args.buffer_bytes, "--input-params": args.input_params}
    given = [flag for flag, value in what_if.items() if value is not None]
    if args.profile:
        if given:
            raise ValueError(f"{', '.join(given)}: what-if settings, which a profile replaces (its "
                             "times, dtype and buffers are measured); give a profile or a what-if")
        return load_profile(args.profile)
    if args.params is None:
        raise ValueError("give a profile.json, or --params with --step-time or "
                         "--flops-per-sample and --gpu-tflops for a what-if")
    if args.step_time is None and args.flops_per_sample is None:
        raise ValueError("--params needs the compute of a step: --step-time SECONDS (forward + "
                         "backward of one GPU), or --flops-per-sample F with --gpu-tflops T")
    if args.flops_per_sample is not None and args.gpu_tflops is None:
        raise ValueError("--flops-per-sample needs --gpu-tflops, the peak TFLOP/s of one GPU")
    if args.step_time is not None and args.mfu is not None:
        raise ValueError("--mfu sets the time from --flops-per-sample and --gpu-tflops; with a "
                         "measured --step-time it would not be used: give one or the other")
    gpu_flops = args.gpu_tflops * 1e12 if args.gpu_tflops else None
    return describe(args.params, step_time=args.step_time, flops_per_sample=args.flops_per_sample,
                    gpu_flops=gpu_flops, utilization=0.4 if args.mfu is None else args.mfu,
                    batch_size=args.batch_size or 1, dtype=args.dtype or "bfloat16",
                    optimizer_time=args.optimizer_time or 0.0, buffer_bytes=args.buffer_bytes or 0.0,
                    input_parameters=args.input_params or 0.0)


def _topology(args: argparse.Namespace, workload, measured):  # -> Topology
    from lockstep.plan.links import Topology, parse_topology

    link = measured or workload.link
    if args.link is None and link is not None:
        # Measured here: every GPU of the plan on this machine's own link.
        return Topology(link, max(args.gpus))
    if args.link is not None and not args.link.strip():
        raise ValueError("--link is empty: give a preset such as nvlink4:8,ib-ndr400, or leave it out")
    return parse_topology(args.link if args.link is not None else "nvlink4:8,ib-ndr400",
                          {"measured": link} if link is not None else None)


def run_plan(args: argparse.Namespace) -> int:
    from lockstep.plan.measure import measure_copy_rate, measure_link_sweep
    from lockstep.plan.model import PlanOptions
    from lockstep.plan.planner import plan

    try:
        workload = _workload(args)
        if args.batch_size and args.profile:
            workload = workload.with_batch(args.batch_size)
        measured = None
        copy_rate = None
        if args.measure_link:
            print(f"measuring all-reduce on {args.nproc} local ranks...", file=sys.stderr)
            sweep = measure_link_sweep(args.nproc)
            measured = sweep.link
            print(f"measured {sweep.describe()}", file=sys.stderr)
        if args.measure_link and workload.device == "cpu":
            copy_rate = measure_copy_rate()
            print(f"measured a plain copy of 32 MiB here at {copy_rate / 1e9:.1f} GB/s (read + "
                  "write): the optimistic end of the bucket copies' rate", file=sys.stderr)
        topology = _topology(args, workload, measured)
        if args.link_efficiency is not None:  # until 2026-11-29 an explicit 1.0 was ignored
            topology = topology.scaled(args.link_efficiency)
        options = PlanOptions(
            optimizer=args.optimizer,
            mixed_precision=None if args.precision == "auto" else args.precision == "mixed",
            gpu_memory=args.gpu_memory * 1e9 if args.gpu_memory else None,
            cpu_cores=args.cpu_cores, copy_rate=copy_rate)
        ranged = not args.no_intervals and args.link_efficiency is None
        result = plan(workload, topology, args.gpus, args.strategies, options, intervals=ranged)
    except (ValueError, OSError) as err:
        print(f"lockstep plan: error: {err}", file=sys.stderr)
        return 2
    if args.json_path == "-":
        json.dump(result.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(result.table())
        if args.json_path:
            try:
                with open(args.json_path, "w", encoding="utf-8") as f:
                    json.dump(result.to_dict(), f, indent=1)
            except OSError as err:
                print(f"lockstep plan: error: cannot write --json {args.json_path}: {err}",
                      file=sys.stderr)
                return 2
            print(f"\nwrote {args.json_path}")
    if args.png_path:
        try:
            result.save_png(args.png_path)
            print(f"wrote {args.png_path}", file=sys.stderr)
        except ModuleNotFoundError as exc:  # matplotlib is optional: the table is the answer
            if not (exc.name or "").startswith("matplotlib"):
                raise
            print(f"skipped {args.png_path}: matplotlib is not installed (pip install matplotlib)",
                  file=sys.stderr)
        except (OSError, ValueError) as err:  # a folder that is not there, an unknown extension
            print(f"lockstep plan: error: cannot write --png {args.png_path}: {err}",
                  file=sys.stderr)
            return 2
    return 0
