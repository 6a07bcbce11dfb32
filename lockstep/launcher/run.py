"""Launch a validated plan on torch.distributed.elastic and turn its outcome into an exit code.

The elastic agent does the process management: it starts the workers, meets the other
machines through the rendezvous, restarts every worker after a failure (``--max-restarts``),
and stops them all when one fails or the launcher is interrupted. lockstep adds what users
see: rank-prefixed output, the root cause of a failure, and a loopback-only rendezvous on a
single machine; and where workers are restarted, workers forked from a server that imported
torch once (:mod:`lockstep.launcher.zygote`), so a restart costs no ``import torch``.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import signal
import socket
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
from lockstep.launcher.launch_plan import (
    DEFAULT_SIGNALS,
    SIGNALS_ENV,
    LaunchPlan,
    to_launch_config,
)
from lockstep.launcher.output import OutputRelay
from lockstep.launcher.rendezvous import register_backends
from lockstep.launcher.worker import LAUNCHER_PID_ENV
from lockstep.launcher.zygote import Zygote, can_fork, forked_worker, worker_args

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
    env = {**plan.worker_env, LAUNCHER_PID_ENV: str(os.getpid()),
           # torch's launcher sets it for the agent's workers; the fork server, started first,
           # must have it too, or forked workers (and the process pools they start) lack it.
           SIGNALS_ENV: str(plan.agent_options.get("signals_to_handle", DEFAULT_SIGNALS))}
    with _log_dir(plan.log_dir) as log_dir, scoped_environ(env):
        forked = _fork_server(plan)
        config = to_launch_config(plan, log_dir, start_method="forkserver" if forked else None)
        try:
            with OutputRelay(log_dir, plan.local_ranks_filter):
                if forked:
                    with _failures_without_traceback():
                        elastic_launch(config, forked_worker)(worker_args(plan.args))
                else:
                    elastic_launch(config, plan.entrypoint)(*plan.args)
        except ChildFailedError as err:
            failures = failures_from(err, log_dir)
            host = socket.gethostname() if plan.max_nodes > 1 else None
            print(format_report(failures, _attempts(log_dir), host), file=sys.stderr, flush=True)
            return exit_code_for(failures[0])
        except SignalException as err:
            name = signal.Signals(err.sigval).name
            print(f"lockstep run: stopped by {name}; every worker was stopped.", file=sys.stderr)
            return 128 + int(err.sigval)
        except RendezvousError as err:
            print(_rendezvous_failure(plan, err), file=sys.stderr, flush=True)
            return 1
    return 0


class _NoTraceback(logging.Filter):
    """Log a record without its exception's traceback (the message says what failed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


@contextlib.contextmanager
def _failures_without_traceback() -> Iterator[None]:
    """The agent logs a forked worker's failure with the launcher's own traceback (where it
    noticed), which says nothing about the worker's and costs seconds the first time (torch's
    log formatter imports much of torch to print it): keep the one line, as for a process."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _NoTraceback()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _fork_server(plan: LaunchPlan) -> bool:
    """Start the workers (and every restart's) by forking them from a server that has torch
    imported, where the plan restarts workers and its command can be forked; whether it does.

    A restart then costs no ``import torch`` (seconds of CPU per worker). Called with the
    workers' environment in ``os.environ``: the server loads torch with it."""
    if not plan.fork_workers or plan.max_restarts < 1 or \
            not can_fork(plan.entrypoint, plan.args):
        return False
    try:
        Zygote(os.environ)
    except (OSError, RuntimeError, ImportError) as err:
        print(f"lockstep run: could not start the fork server ({err}); workers start as new "
              "interpreters instead", file=sys.stderr, flush=True)
        return False
    return True


def _rendezvous_failure(plan: LaunchPlan, err: RendezvousError) -> str:
    """The message for machines that could not meet; lockstep's own errors say what was seen."""
    text = str(err)
    if isinstance(err, RendezvousTimeoutError) and text.startswith("no rendezvous at"):
        return f"lockstep run: {text}"
    if isinstance(err, RendezvousConnectionError):
        if text.startswith("cannot reach") or "no rendezvous store answered" in text:
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
