"""Launch a validated plan on torch.distributed.elastic and turn its outcome into an exit code.

The elastic agent does the process management: it starts the workers, meets the other
machines through the rendezvous, restarts every worker after a failure (``--max-restarts``),
and stops them all when one fails or the launcher is interrupted. lockstep adds what users
see: rank-prefixed output, the root cause of a failure, and a loopback-only rendezvous on a
single machine.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import elastic_launch

from lockstep.launcher.errors import exit_code_for, failures_from, format_report
from lockstep.launcher.launch_plan import LaunchPlan, to_launch_config
from lockstep.launcher.output import OutputRelay
from lockstep.launcher.rendezvous import register_backends
from lockstep.launcher.worker import LAUNCHER_PID_ENV

__all__ = ["launch", "scoped_environ"]


@contextlib.contextmanager
def scoped_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them.

    The elastic agent gives workers a copy of the launcher's environment, so this is how
    variables reach them; restoring keeps an in-process launch (tests, notebooks) clean.
    """
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _log_dir(requested: str | None) -> Iterator[str]:
    """A fresh folder inside the user's ``--log-dir``, kept; or a private one, removed afterwards.

    Fresh even in a reused ``--log-dir``: output relaying and failure reports look for
    ``attempt_*`` folders, and must never pick up an earlier run's.
    """
    if requested:
        os.makedirs(requested, exist_ok=True)
        yield tempfile.mkdtemp(prefix="lockstep_run_", dir=requested)
        return
    path = tempfile.mkdtemp(prefix="lockstep_run_")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _attempts(log_dir: str) -> int:
    return len({os.path.basename(p) for p in glob.glob(os.path.join(log_dir, "*", "attempt_*"))})


def launch(plan: LaunchPlan) -> int:
    """Run ``plan`` to completion; returns the process exit status (0 on success).

    On failure the root cause (rank, exit code or signal, Python traceback) is printed to
    stderr after every worker has been stopped.
    """
    if plan.survivors:
        from lockstep.launcher.survivors import supervise

        return supervise(plan)
    register_backends()
    env = {**plan.worker_env, LAUNCHER_PID_ENV: str(os.getpid())}
    with _log_dir(plan.log_dir) as log_dir, scoped_environ(env):
        config = to_launch_config(plan, log_dir)
        try:
            with OutputRelay(log_dir, plan.local_ranks_filter):
                elastic_launch(config, plan.entrypoint)(*plan.args)
        except ChildFailedError as err:
            failures = failures_from(err, log_dir)
            print(format_report(failures, _attempts(log_dir)), file=sys.stderr, flush=True)
            return exit_code_for(failures[0])
        except SignalException as err:
            name = signal.Signals(err.sigval).name
            print(f"lockstep run: stopped by {name}; every worker was stopped.", file=sys.stderr)
            return 128 + int(err.sigval)
        except RendezvousError as err:
            print(_rendezvous_failure(plan, err), file=sys.stderr, flush=True)
            return 1
    return 0


def _rendezvous_failure(plan: LaunchPlan, err: RendezvousError) -> str:
    """The message for machines that could not meet; lockstep's own errors say what was seen."""
    text = str(err)
    if isinstance(err, RendezvousTimeoutError) and text.startswith("no rendezvous at"):
        return f"lockstep run: {text}"
    if isinstance(err, RendezvousConnectionError):
        if text.startswith("cannot reach"):
            return f"lockstep run: {text}"
        return (
            f"lockstep run: lost the rendezvous store at {plan.rdzv_endpoint}: the launcher that "
            "hosted it (on the machine that owns that address) stopped or cannot be reached, "
            "and no machine can go on without it. Start the job again (it resumes from its "
            "last checkpoint), with the endpoint on a machine that stays."
        )
    return (
        f"lockstep run: the machines could not meet at {plan.rdzv_endpoint} "
        f"({type(err).__name__}: {text}). Check that every machine runs the same "
        "--nnodes, --rdzv-id and --rdzv-endpoint and can reach that address."
    )
