"""What each worker process runs: the user's script, unchanged, under torch's error recorder.

``lockstep run`` starts ``python -u -m lockstep.launcher.worker script.py args...`` rather than
the script itself so that a worker's uncaught exception reaches the launcher with its traceback
(through torch.distributed.elastic's ``@record`` and ``TORCHELASTIC_ERROR_FILE``) without users
decorating their ``main``. The script still runs as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as ``python script.py`` would give it.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from lockstep.diagnose import progress
from lockstep.launcher.errors import trim_traceback
from lockstep.launcher.output import RANK_FILE

__all__ = ["LAUNCHER_PID_ENV", "main", "run_script"]

# The launcher puts its pid here so a worker can tell that it was orphaned before it could
# ask the kernel to be signalled on the launcher's death.
LAUNCHER_PID_ENV = "LOCKSTEP_LAUNCHER_PID"

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_launcher() -> None:
    """Ask Linux to SIGTERM this worker when the launcher dies, even by SIGKILL.

    torch's agent stops workers on every exit it can see; this covers the one it cannot
    (the launcher killed outright), so no worker is left holding a GPU or a port.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        sys.exit(f"lockstep worker: the launcher (pid {launcher}) is gone; exiting")


def _announce_rank() -> None:
    """Write this worker's global rank beside its log files, for the launcher's line prefix."""
    error_file, rank = os.environ.get("TORCHELASTIC_ERROR_FILE"), os.environ.get("RANK")
    if not error_file or rank is None:
        return
    try:
        with open(os.path.join(os.path.dirname(error_file), RANK_FILE), "w") as fh:
            fh.write(rank)
    except OSError:
        pass  # the launcher then prefixes with the local rank


@record
def run_script(target: str, args: list[str], as_module: bool = False) -> None:
    """Run ``target`` (a script path, or a module name) as ``__main__`` with ``args``."""
    if as_module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    # `python script.py` puts the script's folder first on the path where `-m` put the cwd.
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    # `python script.py` (3.9+) and torchrun give the script an absolute __file__.
    runpy.run_path(os.path.abspath(target), run_name="__main__")


def _observe_torch_ddp() -> None:
    """Under ``lockstep doctor`` (``LOCKSTEP_PROFILE``): record torch's own DDP as well."""
    from lockstep.doctor.profile_env import profiling_requested

    if profiling_requested():
        from lockstep.doctor.torch_ddp import observe_torch_ddp

        observe_torch_ddp()


def _traceback_of(exc: BaseException) -> str:
    """The user's traceback, as :func:`~lockstep.launcher.errors.trim_traceback` shows it
    (without the backend's story behind a collective error lockstep named)."""
    return trim_traceback("".join(traceback.format_exception(exc)))


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m lockstep.launcher.worker [-m] TARGET [ARGS...]``."""
    argv = sys.argv[1:] if argv is None else argv
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m lockstep.launcher.worker [-m] TARGET [ARGS...]")
    _die_with_launcher()
    _announce_rank()
    _observe_torch_ddp()
    try:
        run_script(argv[0], argv[1:], as_module)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's script is reported
        # Printed here rather than by Python's hook: torch.distributed's hook prefixes each
        # line with the rank, which the launcher already does. The rank's progress record
        # says it failed of its own error (peers waiting for it name it so).
        progress.note_error(exc)
        print(_traceback_of(exc), file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        # Ctrl-C reaches every worker; the launcher reports it once.
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
