"""The root cause of a failed job: which rank failed first, how, and its Python traceback.

torch.distributed.elastic collects one ``ProcessFailure`` per failed worker, with the
traceback its ``@record`` wrapper wrote to ``TORCHELASTIC_ERROR_FILE``. When one worker dies,
its peers usually fail right after in a collective ("connection closed by peer"), within the
same second, so the earliest timestamp alone does not tell cause from consequence; lockstep
ranks a death by signal or a genuine exception ahead of those echoes.
"""

from __future__ import annotations

import glob
import os
import re
import signal
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

__all__ = [
    "Failure",
    "exit_code_for",
    "failures_from",
    "format_report",
    "root_cause",
    "trim_traceback",
]

# Messages of a worker that failed because a peer went away, not on its own.
_PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|DistNetworkError|broken pipe|recvBytes|"
    r"Socket Timeout|NCCL communicator was aborted|ProcessGroup.*aborted",
    re.IGNORECASE,
)
# Frames of the launcher's own machinery, dropped from the traceback shown to users.
_MACHINERY = re.compile(
    r'File "(<frozen runpy>|.*runpy\.py|.*lockstep/launcher/worker\.py|.*multiprocessing/errors)'
)
_STDERR_TAIL_LINES = 20


@dataclass(frozen=True)
class Failure:
    """One failed worker, as reported to the user."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    timestamp: int
    summary: str
    traceback: str

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` for a worker killed by a signal, else None."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return str(-self.exitcode)

    def how(self) -> str:
        """``"exit code 1"`` or ``"signal SIGKILL (9)"``."""
        if self.signal_name:
            return f"signal {self.signal_name} ({-self.exitcode})"
        return f"exit code {self.exitcode}"


def trim_traceback(callstack: str) -> str:
    """Drop runpy's and the launcher's frames so the traceback starts in the user's script."""
    lines = callstack.rstrip().splitlines()
    kept: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith("  File "):
            skipping = bool(_MACHINERY.search(line))
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _stderr_tail(log_dir: str | None, local_rank: int) -> str:
    """The last lines this local rank wrote to stderr in the newest attempt, if logged."""
    if not log_dir:
        return ""
    paths = glob.glob(
        os.path.join(log_dir, "**", "attempt_*", str(local_rank), "stderr.log"), recursive=True
    )
    if not paths:
        return ""
    newest = max(paths, key=lambda p: int(re.search(r"attempt_(\d+)", p).group(1)))
    with open(newest, errors="replace") as fh:
        return "".join(fh.readlines()[-_STDERR_TAIL_LINES:]).rstrip()


def _from_process_failure(rank: int, pf: ProcessFailure, log_dir: str | None) -> Failure:
    message = pf.message
    if isinstance(message, dict):
        summary = str(message.get("message", ""))
        callstack = str(message.get("extraInfo", {}).get("py_callstack", ""))
    else:
        summary, callstack = str(message), ""
    exitcode = pf.exitcode
    if callstack:
        trace = trim_traceback(callstack)
        if exitcode == -signal.SIGTERM:
            # It had raised and recorded its exception when the launcher, stopping the job
            # because another rank failed, terminated it on its way out: it failed on its own.
            exitcode = 1
    else:
        # No error file: killed by a signal, or exited without a Python exception.
        summary = ""
        trace = _stderr_tail(log_dir, pf.local_rank)
    return Failure(rank, pf.local_rank, pf.pid, exitcode, pf.timestamp, summary, trace)


def failures_from(error: ChildFailedError, log_dir: str | None = None) -> list[Failure]:
    """Every failed worker of ``error``, root cause first."""
    found = [_from_process_failure(r, pf, log_dir) for r, pf in error.failures.items()]
    return sorted(found, key=_cause_order)


def _cause_order(failure: Failure) -> tuple[int, int, int]:
    if _PEER_LOST.search(failure.summary) or _PEER_LOST.search(failure.traceback[-2000:]):
        kind = 2  # failed because a peer went away
    elif failure.exitcode == -signal.SIGTERM and not failure.summary:
        kind = 1  # most likely the agent stopping it once another rank had failed
    else:
        kind = 0  # its own exception, or a signal from outside (OOM killer, kill -9)
    return (kind, failure.timestamp, failure.rank)


def root_cause(error: ChildFailedError, log_dir: str | None = None) -> Failure:
    """The failure that most likely caused the others."""
    return failures_from(error, log_dir)[0]


def exit_code_for(failure: Failure) -> int:
    """The launcher's exit status: the worker's, or 128 + signal as shells report a kill."""
    return 128 - failure.exitcode if failure.exitcode < 0 else (failure.exitcode or 1)


def format_report(failures: list[Failure], attempts: int = 1) -> str:
    """The message printed when the job fails, root cause first."""
    cause = failures[0]
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    lines = [
        f"lockstep run: the job failed{tries}; every worker was stopped.",
        f"Root cause: rank {cause.rank} (local rank {cause.local_rank}, pid {cause.pid}) "
        f"ended with {cause.how()}.",
    ]
    if cause.traceback:
        lines += ["", cause.traceback]
    elif cause.summary:
        lines += ["", cause.summary]
    others = [f"rank {f.rank} ({f.how()})" for f in failures[1:]]
    if others:
        lines += ["", "Also failed, probably as a consequence: " + ", ".join(others) + "."]
    return "\n".join(lines)
