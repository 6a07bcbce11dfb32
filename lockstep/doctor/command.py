"""``lockstep doctor``: run a script at world 1 and world N, and explain the speedup.

The script runs unchanged under ``lockstep run``: the doctor only sets ``LOCKSTEP_PROFILE*``
(see ``profile_env.py``), which every :class:`lockstep.DistributedDataParallel` reads, and stops each
run after ``--steps`` steps. Both runs use the script's own batch per worker, so world N does N
times the work of world 1 per step (a script that splits a global batch is compared per sample:
see :mod:`~lockstep.doctor.account`). On a machine without GPUs the world-1 run gets one worker's
share of the cores (``OMP_NUM_THREADS``), as one of N workers would. When the world-1 run fails
(a script written for N workers), the world-N run is still explained, without the account;
a failure that does not depend on the worker count (invalid Python, checked before any run; a
refused argument; an error after training began) ends the doctor without the world-N run.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path
from typing import Any

from lockstep.doctor.account import Account, speedup_account
from lockstep.doctor.profile_env import PROFILE_ENV, STEPS_ENV, WARMUP_ENV
from lockstep.doctor.profile_file import (
    build_profile,
    load_ranks,
    steps_ended_in_warmup,
    timeline,
)
from lockstep.doctor.render import plot_timeline, write_trace

__all__ = ["add_doctor_arguments", "findings_text", "run_doctor"]


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", type=int, default=2, metavar="N",
        help="workers of the run to explain (default 2); it is compared with 1 worker")
    add("--steps", type=int, default=40, help="steps each run trains (default 40)")
    add("--warmup", type=int, default=5, help="first steps left out of the figures (default 5)")
    add("--out-dir", type=Path, default=Path("doctor"),
        help="where profile.json, summary.json, timeline.png and trace.json go")
    add("--no-baseline", action="store_true",
        help="skip the 1-worker run: attribution only, no speedup account")
    add("--dp-vs-ddp", action="store_true",
        help="instead: the script is a .py file defining model_fn() and batch_fn(step); run it "
             "under DataParallel and under DDP on --nproc-per-node devices and compare")
    add("--dp-threads", type=int, default=None, metavar="T",
        help="with --dp-vs-ddp on CPU: threads in all; DataParallel's process gets T, each DDP "
             "process T / N (default: one per device)")
    add("training_script", help="the training script, unchanged")
    # optional (argparse marks a REMAINDER positional required, and a missing script then read
    # "required: training_script, training_script_args" until 2026-11-29)
    add("training_script_args", nargs=argparse.REMAINDER, help="its arguments").required = False


def _launch(args: argparse.Namespace, world: int, folder: Path) -> int:
    from lockstep.launcher.flags import add_run_arguments
    from lockstep.launcher.launch_plan import plan_from_args
    from lockstep.launcher.run import launch, scoped_environ

    folder.mkdir(parents=True, exist_ok=True)
    # An earlier run's files would pass for this run's if this one writes none (it fails).
    for old in [*folder.glob("rank*.json"), folder / "profile.json"]:
        old.unlink(missing_ok=True)
    env = {PROFILE_ENV: str(folder.resolve()), STEPS_ENV: str(args.steps),
           WARMUP_ENV: str(args.warmup)}
    if world == 1 and args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            env["OMP_NUM_THREADS"] = str(max(1, cores // args.nproc_per_node))
    # `lockstep run`'s own flags and defaults (launcher/flags.py), so the doctor's runs are
    # planned exactly as `lockstep run --nproc-per-node WORLD script args` would be.
    run_parser = argparse.ArgumentParser(prog="lockstep run")
    add_run_arguments(run_parser)
    run_args = run_parser.parse_args(
        ["--nproc-per-node", str(world), args.training_script, *args.training_script_args])
    plan = plan_from_args(run_args)
    print(f"lockstep doctor: running {args.training_script} on {world} worker(s) for at most "
          f"{args.steps} steps", file=sys.stderr, flush=True)
    with scoped_environ(env):
        return launch(plan)


def findings_text(profile: dict[str, Any], account: Account | None = None) -> str:
    """The attribution in words, and the per-bucket table (``account``: the speedup account,
    which says whether a straggler in data is every rank's slow loader)."""
    att = profile["attribution"]
    lines = ["findings:"]
    if profile["world_size"] > 1:
        s = att["straggler"]
        if account is not None and account.data_bound:
            lines.append(f"  data-bound on every rank, not one slow rank: rank {s['rank']} shows "
                         f"{s['phase_excess_s'] * 1e3:.1f} ms more data time than the others, "
                         "whose loaders catch up while they wait at the all-reduce, and the "
                         "1-worker run waits as long for its data")
        elif s["rank"] is None:
            lines.append(f"  no straggler: the ranks wait {s['waited_s'] * 1e3:.1f} ms per step "
                         "for each other, the slowest one changing from step to step")
        else:
            lines.append(f"  straggler: rank {s['rank']}, {s['phase_excess_s'] * 1e3:.1f} ms "
                         f"slower in {s['phase']}; the others wait {s['waited_s'] * 1e3:.1f} "
                         f"ms per step for it (slowest in {s['slowest_share']:.0%} of the steps)")
        if not att.get("buckets_observed", True):
            lines.append(
                f"  communication: buckets not observed (the script registers its own comm hook "
                f"before the first forward; see the warning above): "
                f"{att['exposed_comm_s'] * 1e3:.1f} ms per step waited for at the end of "
                "backward. Register the hook after the first forward to see each bucket")
        else:
            lines.extend(_bucket_lines(profile))
    per = profile["per_rank"]
    keys = ("data", "forward", "backward", "exposed_comm", "optimizer", "other", "step")
    lines.append("  per rank (ms/step): " + "  ".join(f"{k}" for k in keys))
    for row in per:
        lines.append(f"    rank {row['rank']}: " + "  ".join(
            f"{row['phases'][k] * 1e3:.1f}" for k in keys))
    return "\n".join(lines)


def _bucket_lines(profile: dict[str, Any]) -> list[str]:
    """The communication line and the per-bucket table (buckets observed)."""
    att, buckets = profile["attribution"], profile["buckets"]
    total = sum(b["bytes"] * b.get("per_step", 1.0) for b in buckets)
    reductions = max((b.get("per_step", 1.0) for b in buckets), default=1.0)
    every = (f" (each bucket reduced {reductions:.3g} times per step: every backward reduces; "
             "accumulate under model.no_sync() to reduce once)" if reductions > 1.05 else "")
    lines = [
        (f"  communication: {len(buckets)} bucket(s), {total / 2**20:.2f} MB per step{every}, "
         f"{att['allreduce_s'] * 1e3:.1f} ms of all-reduce at {att['busbw'] / 1e9:.3f} GB/s "
         f"bus bandwidth; backward hid {att['hidden_share']:.0%} of it, "
         f"{att['exposed_comm_s'] * 1e3:.1f} ms exposed"),
        (f"  {'bucket':>6} {'MB':>7} {'ready':>9} {'all-reduce':>11} "
         f"{'busbw GB/s':>11} {'exposed':>9}  last gradient"),
    ]
    for b in buckets:
        lines.append(
            f"  {b['index']:>6} {b['bytes'] / 2**20:>7.2f} {b['ready'] * 1e3:>6.1f} ms "
            f"{b['allreduce'] * 1e3:>8.1f} ms {b['busbw'] / 1e9:>11.3f} "
            f"{b['exposed'] * 1e3:>6.1f} ms  {b['last_param'] or '-'}")
    return lines


def _profile_of(folder: Path, warmup: int) -> dict[str, Any]:
    """The run's profile, written to ``folder/profile.json``.

    Raises:
        FileNotFoundError: no rank wrote its profile.
        ValueError: the run ended within its warm-up steps (nothing left to measure).
    """
    ranks = load_ranks(folder)
    ran = steps_ended_in_warmup(ranks, warmup)
    if ran is not None:
        raise ValueError(f"the script ended after {ran} step(s), within the {warmup} warm-up "
                         "steps, so no step is left to measure: lower --warmup or let it run "
                         "longer (more data, a larger --max-steps of its own)")
    profile = build_profile(ranks)
    (folder / "profile.json").write_text(json.dumps(profile, indent=1))
    return profile


def _syntax_error(script: str) -> str | None:
    """Why ``script`` is not valid Python (None: it parses, or it is no file to read)."""
    path = Path(script)
    if not path.is_file():
        return None  # `lockstep run` names a missing script
    try:
        ast.parse(path.read_bytes(), filename=script)
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes
        return f"{script} is not valid Python: {err}; fix it (nothing was run)"
    return None


def _fails_at_any_world(folder: Path, rc: int, in_warmup: bool, n: int) -> str | None:
    """Why the failed 1-worker run would fail as well with ``n`` workers (None: it may not).

    A script written for N workers (Lightning's ``devices=N``) refuses one worker before it
    trains, with an error or an exit: the N-worker run is then still worth explaining. A
    failure after training began, an argument error or an end within the warm-up does not
    depend on the worker count, and running again only prints it again.
    """
    if in_warmup:
        return f"the {n}-worker run would end within its warm-up too"
    if rc == 2:  # argparse's status for arguments it refuses; the N-worker run gets the same
        return (f"exit 2 is the status of a script refusing its arguments (an unknown flag?), "
                f"and the {n}-worker run gets the same ones")
    steps = 0
    for file in folder.glob("rank*.json"):
        try:
            steps = max(steps, len(json.loads(file.read_text()).get("steps", [])))
        except (OSError, ValueError):
            continue  # a file cut short: no evidence either way
    if steps:
        return (f"the script trained {steps} step(s) on 1 worker before it failed, so the "
                "worker count is not what failed it: fix the error above")
    return None


def run_doctor(args: argparse.Namespace) -> int:
    """Both runs, then the account, the findings and the pictures; returns the exit status."""
    n = args.nproc_per_node
    if n < 1 or args.steps <= args.warmup or args.warmup < 0:
        print(f"lockstep doctor: error: need --nproc-per-node >= 1 and --steps > --warmup >= 0 "
              f"(got {n}, {args.steps}, {args.warmup})", file=sys.stderr)
        return 2
    if args.dp_vs_ddp:
        return _run_dp_vs_ddp(args)
    invalid = _syntax_error(args.training_script)
    if invalid is not None:  # nothing is run: both runs would print the same error
        print(f"lockstep doctor: error: {invalid}", file=sys.stderr)
        return 2
    out: Path = args.out_dir
    worlds = [n] if args.no_baseline or n == 1 else [1, n]
    profiles: dict[int, dict[str, Any]] = {}
    baseline_failed: str | None = None  # why the 1-worker run gave no baseline
    for stale in ("profile.json", "summary.json", "trace.json", "timeline.png"):
        if out.is_dir():  # the report of an earlier run: gone unless this one writes its own
            (out / stale).unlink(missing_ok=True)
    for world in worlds:
        try:
            rc = _launch(args, world, out / f"world{world}")
        except ValueError as err:  # the script or a flag, as `lockstep run` names them
            print(f"lockstep doctor: error: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # --out-dir cannot be made (a file there, no permission)
            print(f"lockstep doctor: error: cannot write into --out-dir {out}: {err}",
                  file=sys.stderr)
            return 2
        failure: str | None = None
        in_warmup = False  # the script ended within the warm-up steps
        if rc != 0:
            failure = f"the {world}-worker run failed (exit {rc}); see above"
        else:
            try:
                profiles[world] = _profile_of(out / f"world{world}", args.warmup)
            except (FileNotFoundError, ValueError) as err:
                failure, in_warmup = f"error: {err}", isinstance(err, ValueError)
        stop = (_fails_at_any_world(out / "world1", rc, in_warmup, n)
                if failure is not None and world == 1 and n > 1 else None)
        if stop is not None:
            print(f"lockstep doctor: {failure}\nlockstep doctor: the {n}-worker run is not "
                  f"started: {stop}", file=sys.stderr)
            return rc or 1
        if failure is not None and world == 1 and n > 1:
            # A script written for N workers (Lightning's devices=N) may refuse to run alone:
            # explain the N-worker run anyway, without the speedup account.
            baseline_failed = failure
            print(f"lockstep doctor: {failure}\nlockstep doctor: the 1-worker baseline failed; "
                  f"explaining the {n}-worker run without it (no speedup account; "
                  "--no-baseline skips it)", file=sys.stderr)
            continue
        if failure is not None:
            print(f"lockstep doctor: {failure}", file=sys.stderr)
            return rc or 1
        recorded = profiles[world]["world_size"]
        if recorded != world:
            print(f"lockstep doctor: error: the {world}-worker run recorded a world of "
                  f"{recorded}: its workers did not join one process group, so each trained "
                  "alone. Start the process group in the script (lockstep.init_distributed() or "
                  "torch.distributed.init_process_group()) and wrap the model in "
                  "DistributedDataParallel", file=sys.stderr)
            return 1
    many = profiles[n]
    account: Account | None = None
    if 1 in profiles and n > 1:
        account = speedup_account(profiles[1], many)
    report = _report(args, many, account, baseline_failed)
    print(report)
    summary = {"world_size": n, "script": args.training_script,
               "account": account.to_json() if account else None,
               "attribution": many["attribution"], "phases": many["phases"],
               "baseline_phases": profiles[1]["phases"] if 1 in profiles else None,
               "baseline_error": baseline_failed}
    many_out = {**many, "account": summary["account"]}
    (out / "profile.json").write_text(json.dumps(many_out, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    ranks = load_ranks(out / f"world{n}")
    title = (f"{Path(args.training_script).name} on {n} worker(s): last steps"
             + (f"; speedup {account.measured:.2f}x of {n}x" if account else ""))
    write_trace(timeline(ranks), out / "trace.json", Path(args.training_script).name)
    png: Path | None = out / "timeline.png"
    try:
        plot_timeline(many["timeline"], out / "timeline.png", title)
    except ModuleNotFoundError as exc:  # matplotlib is optional: pictures only, never the report
        if not (exc.name or "").startswith("matplotlib"):
            raise
        print(f"skipped {out / 'timeline.png'}: matplotlib is not installed (pip install matplotlib)")
        png = None
    wrote = f"{out / 'profile.json'}, {out / 'summary.json'}" + (f", {png}" if png else "")
    print(f"wrote {wrote} and {out / 'trace.json'} (open it in ui.perfetto.dev)")
    return 0


def _run_dp_vs_ddp(args: argparse.Namespace) -> int:
    """``--dp-vs-ddp``: the DataParallel section and the measured DDP saving."""
    from lockstep.doctor.dp_vs_ddp import compare_dp_ddp, load_models_file

    try:
        functions = load_models_file(args.training_script)
        # "spawn": each DDP worker is a new interpreter, which imports the file by its name.
        result = compare_dp_ddp(devices=args.nproc_per_node, steps=args.steps - args.warmup,
                                warmup=args.warmup, threads=args.dp_threads,
                                start_method="spawn", **functions)
    except (FileNotFoundError, ValueError) as err:
        print(f"lockstep doctor: error: {err}", file=sys.stderr)
        return 2
    print(result.table())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "dp_vs_ddp.json").write_text(json.dumps(result.to_json(), indent=1))
    print(f"wrote {args.out_dir / 'dp_vs_ddp.json'}")
    return 0


def _report(args: argparse.Namespace, many: dict[str, Any], account: Account | None,
            baseline_failed: str | None = None) -> str:
    head = (f"\nlockstep doctor: {args.training_script} on {many['world_size']} worker(s) "
            f"({', '.join(str(x) for x in (many['backend'], many['device']) if x)}), batch {many['batch_size_per_rank']} per "
            f"worker, {many['steps']} steps after {args.warmup} warm-up")
    parts = [head]
    if account is not None:
        parts.append(account.table())
    elif baseline_failed is not None:
        parts.append(f"no speedup account: the 1-worker baseline run gave no profile "
                     f"({baseline_failed}); the findings below are the "
                     f"{many['world_size']}-worker run's alone")
    parts.append(findings_text(many, account))
    return "\n".join(parts)
