"""The root cause of a failed job: which rank failed first, how, and its Python traceback.

torch.distributed.elastic collects one ``ProcessFailure`` per failed worker, with the
traceback its ``@record`` wrapper wrote to ``TORCHELASTIC_ERROR_FILE``. When one worker dies,
its peers usually fail right after in a collective ("connection closed by peer"), within the
same second, so the earliest timestamp alone does not tell cause from consequence; lockstep
ranks a death by signal or a genuine exception ahead of those echoes.

Better still is the peers' own word: a worker whose collective failed because a peer never
arrived leaves a "blame" file naming that peer (:mod:`lockstep.diagnose.hang`). The rank named there is
the root cause — whether it hung (and the agent then ended it with SIGTERM), left the loop early
with exit code 0, or called a different collective — never the rank that waited.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)

from lockstep.diagnose.hang import read_blame

__all__ = [
    "Failure",
    "attempt_evidence",
    "exit_code_for",
    "failures_from",
    "format_report",
    "root_cause",
    "trim_traceback",
]

# Messages of a worker that failed because a peer went away, not on its own.
_PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|DistNetworkError|broken pipe|recvBytes|"
    r"Socket Timeout|NCCL communicator was aborted|ProcessGroup.*aborted|"
    # gloo's own timeout: this rank waited for a peer's send or receive that never came.
    r"Timed out waiting \d+ms for (recv|send) operation",
    re.IGNORECASE,
)
# Frames of the launcher's own machinery, dropped from the traceback shown to users.
_MACHINERY = re.compile(
    r'File "(<frozen runpy>|.*runpy\.py|.*lockstep/launcher/worker\.py|.*multiprocessing/errors)'
)
_STDERR_TAIL_LINES = 20
_NAMED_COLLECTIVE_ERROR = "CollectiveTimeoutError: "
_TRACEBACK_HEAD = "Traceback (most recent call last):"


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
    # Set when peers named this rank as the one they waited for: what they said.
    blame: str = ""
    blamed_by: tuple[int, ...] = ()

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
    """Drop runpy's and the launcher's frames so the traceback starts in the user's script.

    A collective error lockstep named (``CollectiveTimeoutError``: "rank 2 on host-b is gone")
    keeps only its own traceback: the backend's error it was raised from (gloo's "Connection
    reset by peer ... GLHF!") names nobody, and its first line is quoted in the message.
    """
    text = callstack.rstrip()
    last_line = text.splitlines()[-1] if text else ""
    if _NAMED_COLLECTIVE_ERROR in last_line and _TRACEBACK_HEAD in text:
        text = text[text.rindex(_TRACEBACK_HEAD):]
    lines = text.splitlines()
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


def _attempt_number(path: str) -> int:
    found = re.search(r"attempt_(\d+)", path)
    return int(found.group(1)) if found else -1


def _stderr_tail(log_dir: str | None, local_rank: int) -> str:
    """The last lines this local rank wrote to stderr in the newest attempt, if logged."""
    if not log_dir:
        return ""
    paths = glob.glob(
        os.path.join(log_dir, "**", "attempt_*", str(local_rank), "stderr.log"), recursive=True
    )
    if not paths:
        return ""
    newest = max(paths, key=_attempt_number)
    with open(newest, errors="replace") as fh:
        return "".join(fh.readlines()[-_STDERR_TAIL_LINES:]).rstrip()


def attempt_evidence(log_dir: str | None) -> tuple[dict[int, dict[str, Any]], bool]:
    """What this launcher's workers said in their newest attempt, read from its log folder.

    Returns the peers they blamed (global rank -> ``host``, ``step``, ``state``, from
    :mod:`lockstep.diagnose.hang`'s blame files), and whether any worker left an error file (the
    attempt ended in a failure rather than being stopped for a membership change).
    """
    if not log_dir:
        return {}, False
    folders = glob.glob(os.path.join(log_dir, "*", "attempt_*"))
    if not folders:
        return {}, False
    newest = max(folders, key=_attempt_number)
    blamed: dict[int, dict[str, Any]] = {}
    failed = False
    for worker in glob.glob(os.path.join(newest, "*")):
        error_file = os.path.join(worker, "error.json")
        failed = failed or os.path.exists(error_file)
        verdict = read_blame(error_file)
        for culprit in (verdict or {}).get("culprits", []):
            if isinstance(culprit.get("rank"), int):
                blamed.setdefault(culprit["rank"], culprit)
    return blamed, failed or bool(blamed)


def _from_process_failure(rank: int, pf: ProcessFailure, log_dir: str | None) -> Failure:
    message = pf.message
    if isinstance(message, dict):
        summary = str(message.get("message", ""))
        callstack = str(message.get("extraInfo", {}).get("py_callstack", ""))
        if callstack.strip() == "NoneType: None":  # recorded without a traceback: its message
            callstack = summary
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
    """Every failed worker of ``error``, root cause first (the rank peers blamed, if any)."""
    found = [_from_process_failure(r, pf, log_dir) for r, pf in error.failures.items()]
    found.sort(key=_cause_order)
    verdicts = {r: v for r, pf in error.failures.items() if (v := read_blame(pf.error_file))}
    if not verdicts:
        return found
    culprit = _most_blamed(verdicts)
    named_by = tuple(sorted(r for r, v in verdicts.items()
                            if any(c.get("rank") == culprit["rank"] for c in v["culprits"])))
    message = verdicts[named_by[0]]["message"] if named_by else ""
    own = next((f for f in found if f.rank == culprit["rank"]), None)
    elsewhere = own is None and culprit.get("host") not in (None, socket.gethostname())
    if own is None:  # it exited with 0 (left early), or is on another machine
        own = Failure(culprit["rank"], _int(culprit.get("local_rank")), _int(culprit.get("pid")),
                      0, 0, "", "")
    blame = _blame_line(culprit, own)
    if elsewhere and blame.startswith("left early"):
        # This launcher cannot see how a process on another machine ended: its machine may be
        # the one that was lost, which "exited" would hide.
        blame = (f"stopped on {culprit['host']}{_where(culprit)} while its peers waited for it: "
                 "its process ended or that machine was lost (its own launcher, if it still "
                 "runs, says which)")
    cause = replace(own, blame=blame, blamed_by=named_by)
    if not cause.summary and message:  # no exception of its own: say what its peers saw
        tail = f"\n\nIts last output:\n{cause.traceback}" if cause.traceback else ""
        said = re.sub(r"^rank \d+: ", "", message)
        cause = replace(cause, traceback=f"rank {named_by[0]} reported: {said}{tail}")
    return [cause] + [f for f in found if f.rank != cause.rank]


def _most_blamed(verdicts: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The culprit most waiting ranks named, as one of them described it.

    Named for missing a meeting (a Checkpointer call) goes first: the rank that skipped it runs
    on and names, in its next collective, the ranks waiting in the meeting. Then the most
    votes; ties: the lowest rank.
    """
    named = [c for v in verdicts.values() for c in v["culprits"] if isinstance(c.get("rank"), int)]
    # A rank named as "exited" that wrote a verdict of its own did not leave the loop early: it
    # gave up waiting (its timeout expired) and named the rank it waited for. A peer that came
    # just after then found it gone and named it back; that vote does not count (until
    # 2026-11-29 the tie of two such votes went to the lowest rank, the one that had waited).
    gave_up = [c for c in named if not (c.get("state") == "exited" and c["rank"] in verdicts)]
    named = gave_up or named
    votes = Counter(c["rank"] for c in named)
    missed = Counter(c["rank"] for c in named if c.get("meeting"))
    rank = min(votes, key=lambda r: (-missed[r], -votes[r], r))
    return next(c for c in sorted(named, key=lambda c: not c.get("meeting")) if c["rank"] == rank)


def _where(culprit: dict[str, Any]) -> str:
    if culprit.get("step") is None:
        return ""
    return f" at step {culprit['step']}, phase {culprit.get('phase')!r}"


def _blame_line(culprit: dict[str, Any], own: Failure) -> str:
    where = _where(culprit)
    state = culprit.get("state")
    if culprit.get("meeting"):
        return f"never called {culprit['meeting']}, which its peers waited in{where}"
    if state == "mismatch":
        return "called a different collective than its peers"
    if state == "skipped":
        return (f"skipped a collective its peers ran{where}: it had entered {culprit.get('count')} "
                f"collectives where they had entered {culprit.get('expected')}")
    if state == "raised" or (state == "exited" and own.exitcode != 0 and _own_error(own)):
        # it raised an error of its own: it failed, it did not leave the loop early
        return f"failed{where} with an error of its own while its peers waited for it"
    if state == "exited" or own.exitcode == 0:
        return f"left early: it exited{where} while its peers waited for it"
    if state == "frozen":
        return (f"froze{where}: its process still ran but gave no sign of life (native code "
                "holding the GIL, or the process stopped); its peers waited for it in vain")
    if state == "gone":
        return f"was gone{where}; its peers waited for it in vain"
    if _own_error(own):  # it raised an error of its own: it failed, it did not hang
        return f"failed{where} with an error of its own while its peers waited for it"
    return f"hung{where}: its peers waited for it in vain"


def _own_error(failure: Failure) -> bool:
    """Did it raise an error of its own (not a lost peer, not a timeout naming another rank)?"""
    summary = failure.summary
    return bool(summary) and not _lost_a_peer(failure) and not summary.startswith(
        ("CollectiveTimeoutError", "CollectiveMismatchError", "CheckpointError"))


def _int(value: Any) -> int:
    return value if isinstance(value, int) else -1


def _lost_a_peer(failure: Failure) -> bool:
    """Did it fail because a peer went away (not on its own)?"""
    return bool(_PEER_LOST.search(failure.summary) or _PEER_LOST.search(failure.traceback[-2000:]))


def _cause_order(failure: Failure) -> tuple[int, int, int]:
    if failure.blame:
        return (-1, failure.timestamp, failure.rank)
    if _lost_a_peer(failure):
        kind = 3  # failed because a peer went away
    elif failure.exitcode == -signal.SIGTERM:
        # Most likely the agent stopping it once another rank had failed; if it had raised
        # already (every rank raising at once), a rank that exited by itself still goes first:
        # its exit code, not the agent's SIGTERM, is the job's.
        kind = 1 if failure.summary else 2
    else:
        kind = 0  # its own exception, or a signal from outside (OOM killer, kill -9)
    return (kind, failure.timestamp, failure.rank)


def root_cause(error: ChildFailedError, log_dir: str | None = None) -> Failure:
    """The failure that most likely caused the others."""
    return failures_from(error, log_dir)[0]


def exit_code_for(failure: Failure) -> int:
    """The launcher's exit status: the worker's, or 128 + signal as shells report a kill.

    A rank its peers blamed that the agent stopped (SIGTERM) or that exited early (0) made
    the job fail: 1, not the launcher's own signal.
    """
    if failure.blame and failure.exitcode in (0, -signal.SIGTERM):
        return 1
    return 128 - failure.exitcode if failure.exitcode < 0 else (failure.exitcode or 1)


def format_report(failures: list[Failure], attempts: int = 1, host: str | None = None) -> str:
    """The message printed when the job fails, root cause first.

    ``host``: this machine's name, in a job of several machines. Where every worker here
    failed only because a peer went away, the root cause is on another machine: the report
    says so, rather than naming a rank here that only lost its connection.
    """
    cause = failures[0]
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    lines = [f"lockstep run: the job failed{tries}; every worker was stopped."]
    known = [f"local rank {cause.local_rank}" if cause.local_rank >= 0 else "",
             f"pid {cause.pid}" if cause.pid >= 0 else ""]  # -1: its peers could not say
    if host:
        known.append(f"on {host}")
    who = f"rank {cause.rank}" + (f" ({', '.join(k for k in known if k)})" if any(known) else "")
    if host and not cause.blame and all(_lost_a_peer(f) for f in failures):
        lines.append(
            f"Root cause: not on this machine. {who[0].upper()}{who[1:]} ended with "
            f"{cause.how()} because it lost its connection to a peer, as every worker here "
            "that failed did: a worker of another machine failed first, or that machine went "
            "away. That machine's launcher names the rank that failed."
        )
    elif cause.blame:
        by = ", ".join(map(str, cause.blamed_by))
        ended = "" if cause.exitcode == 0 else f"; it then ended with {cause.how()}"
        if cause.exitcode == -signal.SIGTERM:
            ended = "; the launcher then stopped it (SIGTERM)"
        lines.append(f"Root cause: {who} {cause.blame} (named by rank(s) {by}){ended}.")
    else:
        lines.append(f"Root cause: {who} ended with {cause.how()}.")
    if cause.traceback:
        lines += ["", cause.traceback]
    elif cause.summary:
        lines += ["", cause.summary]
    # Ranks that raised an error of their own failed for their own reason, not because of the
    # root cause: say what each raised (its traceback is in its own output).
    own = [f"rank {f.rank} ({f.how()}: {_first_line(f.summary)})" for f in failures[1:]
           if _own_error(f)]
    others = [f"rank {f.rank} ({f.how()})" for f in failures[1:] if not _own_error(f)]
    if own:
        lines += ["", "Also failed with an error of its own: " + ", ".join(own) + "."]
    if others:
        lines += ["", "Also failed, probably as a consequence: " + ", ".join(others) + "."]
    return "\n".join(lines)


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
