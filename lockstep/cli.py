"""The ``lockstep`` command line: ``lockstep run [torchrun's flags] script.py [args]``.

Each subcommand adds its arguments to the parser and names the function that runs it, so
later subcommands slot in beside ``run``.

Example::

    lockstep run --nproc-per-node 2 train.py --epochs 3
    python -m lockstep run --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --nproc-per-node auto train.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_RUN_EPILOG = """\
Workers get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...), so a script that calls
lockstep.init_distributed() runs unchanged under lockstep run, torchrun, srun or plain python.
On one machine every port lockstep opens listens on 127.0.0.1 only."""


def _run(args: argparse.Namespace) -> int:
    # Imported here so `lockstep --help` does not pay for torch.distributed.elastic.
    from lockstep.launcher.launch_plan import plan_from_args
    from lockstep.launcher.run import launch

    try:
        plan = plan_from_args(args)
    except ValueError as err:
        print(f"lockstep run: error: {err}", file=sys.stderr)
        return 2
    return launch(plan)


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    from lockstep.launcher.flags import add_run_arguments

    parser = subparsers.add_parser(
        "run",
        help="run a training script on several workers (torchrun's flags)",
        description="Run TRAINING_SCRIPT on --nproc-per-node workers on each of --nnodes machines.",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=_run)


def _plan(args: argparse.Namespace) -> int:
    from lockstep.plan.cli import run_plan

    return run_plan(args)


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    from lockstep.plan.cli import add_plan_arguments

    parser = subparsers.add_parser(
        "plan",
        help="predict step time and scaling efficiency at many GPUs from a profile",
        description="Predict step time, samples/s, scaling efficiency, exposed communication and "
        "memory per GPU for each strategy and GPU count (see docs/plan.md).",
    )
    add_plan_arguments(parser)
    parser.set_defaults(handler=_plan)


def _doctor(args: argparse.Namespace) -> int:
    from lockstep.doctor.command import run_doctor

    return run_doctor(args)


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    from lockstep.doctor.command import add_doctor_arguments

    parser = subparsers.add_parser(
        "doctor",
        help="explain the speedup: run at 1 and N workers, name what costs the time",
        description="Run TRAINING_SCRIPT unchanged at 1 and at N workers for a few steps, "
        "profile every rank, and print where the ideal N-times speedup went.",
    )
    add_doctor_arguments(parser)
    parser.set_defaults(handler=_doctor)


def build_parser() -> argparse.ArgumentParser:
    """The ``lockstep`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Data-parallel training for PyTorch."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(subparsers)
    _add_doctor(subparsers)
    _add_plan(subparsers)
    for sub in subparsers.choices.values():  # so that main() has it say what it refuses
        sub.set_defaults(command_parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lockstep`` command line; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = vars(args).pop("command_parser", parser)
    if unknown:  # said by the subcommand, with its usage (until 2026-11-29 the top-level one)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
