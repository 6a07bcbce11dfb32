"""A collective that a peer never joined fails naming that peer, where it was, and whether it lives.

The backend's own error ("Timed out waiting 600000ms for recv", "Connection closed by peer")
names no rank. lockstep's collectives wait through :func:`wait` or :func:`run`: when the
backend gives up, the waiting rank reads every peer's progress record (see
:mod:`lockstep.diagnose.progress`), watches their heartbeats for a moment, and raises
:class:`CollectiveTimeoutError` naming the ranks that did not arrive: alive but stuck (with
step, phase and last collective), gone (no heartbeat: died, or its machine was lost), or exited
(left the loop early). Nothing extra runs while collectives succeed.

The waiting rank also leaves a small JSON "blame" file beside torch elastic's error file, so
``lockstep run`` reports the rank that stopped as the root cause, not the ones that waited
(the peer watch and the blame file are :mod:`lockstep.diagnose.blame`'s, re-exported here).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# The peer watch and the blame file live in lockstep.diagnose.blame (the abort guard uses them too);
# they are re-exported here, where they were first written.
from lockstep.diagnose.blame import BLAME_FILE, observe_peers, read_blame, write_blame
from lockstep.diagnose.progress import GroupProgress, tracker
from lockstep.diagnose.stackdump import request_stack
from lockstep.env import process_runs

__all__ = [
    "BLAME_FILE",
    "CollectiveTimeoutError",
    "Culprit",
    "LocalUsageError",
    "call_as",
    "describe_missing",
    "from_peer",
    "observe_peers",
    "read_blame",
    "run",
    "wait",
    "write_blame",
]

# Errors of a backend whose peer went away or never came (gloo, NCCL, the store).
_PEER_TROUBLE = re.compile(
    r"timed? ?out|timeout|connection (closed|reset)|closed by peer|broken pipe|recvBytes|"
    r"DistNetworkError|DistBackendError|aborted|peer",
    re.IGNORECASE,
)


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete; ``missing_ranks`` are the global ranks that did not arrive.

    Attributes:
        op: the collective, e.g. ``"DDP gradient all-reduce (bucket 0)"``.
        missing_ranks: the ranks named as the cause (empty when none could be named).
    """

    def __init__(self, message: str, op: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.op = op
        self.missing_ranks = missing_ranks


class LocalUsageError(RuntimeError):
    """A mistake in this rank's own code (e.g. a comm hook's return value), not a peer's absence.

    :func:`call_as` and :func:`wait` pass it through as it is: no peer is blamed for it.
    """


class Culprit:
    """One rank that did not arrive, as the waiting rank saw it."""

    def __init__(
        self, rank: int, state: str, record: dict[str, Any] | None, group_key: str = ""
    ) -> None:
        self.rank = rank
        self.state = state  # "stuck", "gone", "exited", "raised", "late" or "silent" (never published)
        self.record = record or {}
        self.group_key = group_key
        self.other_op = ""  # set when it entered the same count in another collective than ours

    def frozen_here(self) -> bool:
        """Whether its process still runs on this host (it stopped beating, but lives)."""
        pid = self.record.get("pid")
        if self.record.get("host") != socket.gethostname() or not isinstance(pid, int):
            return False
        return process_runs(pid)

    def where(self) -> str:
        rec = self.record
        last = ""
        if rec.get("last_op"):
            seq = _count(rec, self.group_key) if self.group_key else 0
            last = f", last collective {'#' + str(seq) + ' ' if seq else ''}{rec['last_op']}"
        return f"step {rec.get('step', 0)}, phase {rec.get('phase', '?')!r}{last}"

    def describe(self, silent_s: float) -> str:
        host = self.record.get("host")
        who = f"rank {self.rank}" + (f" on {host}" if host else "")
        if self.other_op:
            theirs = self.record.get("last_ops", {}).get(self.group_key, "?")
            return (f"{who} entered this collective's number too, but in another collective: "
                    f"{theirs} (this rank is in {self.other_op}), at step "
                    f"{self.record.get('step', 0)}. The ranks run different collectives here: "
                    "code that communicates on some ranks only, or uneven data under join() "
                    "with a component it cannot stand in for (lockstep's "
                    "ZeroRedundancyOptimizer is not a Joinable)")
        if self.state == "stuck":
            return (f"{who} did not arrive: it is alive but stuck at {self.where()} "
                    f"(inspect it: py-spy dump --pid {self.record.get('pid')}; if it is only "
                    "slow, e.g. an evaluation on one rank, raise init_distributed(timeout=...))")
        if self.state == "gone" and self.frozen_here():
            return (f"{who} is frozen: its process (pid {self.record.get('pid')}) still runs on "
                    f"this host but has given no sign of life for {silent_s:.1f}s (native code "
                    "holding the GIL, or the process stopped); it was last at "
                    f"{self.where()}")
        if self.state == "gone":
            return (f"{who} is gone: no sign of life for {silent_s:.1f}s (its process died or "
                    f"froze, or its machine was lost); it was last at {self.where()}")
        if self.state == "late":
            return (f"{who} arrived only after this rank gave up: it was still at {self.where()} "
                    "when the timeout expired. It is slow, not stuck: find what delays it, or "
                    "raise the timeout (lockstep.init_distributed(timeout=...))")
        if self.state == "raised":
            return (f"{who} failed with an error of its own at {self.where()} "
                    f"({self.record.get('error') or 'see its traceback'}): its peers waited for "
                    "it in vain")
        if self.state == "exited":
            return (f"{who} exited while its peers still needed it, at {self.where()}: it left "
                    "the training loop early (uneven data? DistributedSampler(drop_last=True) "
                    "or model.join())")
        return (f"{who} never published its progress: it died at start-up or has not reached "
                "lockstep code yet")

    def as_dict(self) -> dict[str, Any]:
        rec = self.record
        state = "frozen" if self.state == "gone" and self.frozen_here() else self.state
        return {"rank": self.rank, "state": state, "host": rec.get("host"),
                "pid": rec.get("pid"), "local_rank": rec.get("local_rank"),
                "step": rec.get("step"), "phase": rec.get("phase"), "last_op": rec.get("last_op")}


def wait(progress: GroupProgress, seq: int, op: str, future: Any) -> Any:
    """``future.wait()`` for collective number ``seq``; on failure, name who did not arrive."""
    start = time.monotonic()
    try:
        return future.wait()
    except Exception as exc:  # the backend's error, which names nobody
        if not isinstance(exc, dist.DistError) and not _PEER_TROUBLE.search(str(exc)):
            raise  # the future's own error (a comm hook's callback, a dtype it cannot add)
        raise _named(progress, seq, op, exc, time.monotonic() - start) from exc


def run(progress: GroupProgress, op: str, call: Callable[[], Any]) -> Any:
    """Run a blocking collective ``call()`` counted as ``op``; on failure, name who is missing."""
    return call_as(progress, progress.enter(op), op, call)


def call_as(progress: GroupProgress, seq: int, op: str, call: Callable[[], Any]) -> Any:
    """``call()`` on behalf of collective number ``seq`` (e.g. a comm hook that launches it)."""
    start = time.monotonic()
    try:
        return call()
    except dist.DistError as exc:
        raise _named(progress, seq, op, exc, time.monotonic() - start) from exc
    except Exception as exc:
        if not _PEER_TROUBLE.search(str(exc)):
            raise  # the call's own error (a comm hook's bug), not a peer's absence: as it is
        raise _named(progress, seq, op, exc, time.monotonic() - start) from exc


def _named(progress: GroupProgress, seq: int, op: str, cause: Exception,
           waited: float) -> Exception:
    """The error to raise instead of ``cause``: a named one, or ``cause`` if nobody is to blame."""
    if isinstance(cause, (CollectiveTimeoutError, LocalUsageError)) or progress.tracker is None:
        return cause
    try:
        culprits, silent_s = _find_culprits(progress, seq, cause, op)
    except Exception:  # noqa: BLE001 - the store's host may be the one gone
        return _store_gone(progress.tracker.rank, op, cause, waited)
    if not culprits:
        return cause
    me = progress.tracker.rank
    named = "; ".join(c.describe(silent_s) for c in culprits)
    error = CollectiveTimeoutError(
        f"rank {me}: {op} failed after waiting {waited:.1f}s (collective #{seq} on ranks "
        f"{progress.ranks}, step {progress.tracker.step}): {named}. Backend error: "
        f"{_first_line(cause)}{_stacks_of(culprits)}", op, [c.rank for c in culprits],
    )
    write_blame(me, [c.as_dict() for c in culprits], str(error))
    return error


def _stacks_of(culprits: list[Culprit]) -> str:
    """The Python stack of each stuck culprit on this host (see :mod:`lockstep.diagnose.stackdump`)."""
    host, parts = socket.gethostname(), []
    for c in culprits:
        pid = c.record.get("pid")
        if (c.state != "stuck" and not (c.state == "gone" and c.frozen_here())
                or not isinstance(pid, int) or c.record.get("host") != host):
            continue  # (faulthandler's dump needs no GIL: a frozen process answers too)
        stack = request_stack(pid)
        if stack:
            parts.append(f"\nPython stack of rank {c.rank} (pid {pid}), where it is stuck:\n{stack}")
    return "".join(parts)


def _store_gone(me: int, op: str, cause: Exception, waited: float) -> CollectiveTimeoutError:
    """The store cannot be read: its host is gone (rank 0, or the launcher's agent)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        where = os.environ.get("MASTER_ADDR")
        host, blamed = (f"the launcher that hosts the job's store (machine 0"
                        f"{', at ' + where if where else ''})"), []
    else:
        host, blamed = "rank 0, which hosts the job's store,", [0]
    message = (
        f"rank {me}: {op} failed after {waited:.1f}s and the store cannot be read: {host} is "
        f"gone (it exited or died). Backend error: {_first_line(cause)}"
    )
    if blamed:
        write_blame(me, [{"rank": 0, "state": "gone"}], message)
    return CollectiveTimeoutError(message, op, blamed)


def _find_culprits(
    progress: GroupProgress, seq: int, cause: Exception, op: str = ""
) -> tuple[list[Culprit], float]:
    found = progress.tracker
    assert found is not None
    peers = [r for r in progress.ranks if r != found.rank]
    first = found.read(peers)
    behind = {r for r, rec in first.items() if _count(rec, progress.key) < seq}
    if not behind and not _PEER_TROUBLE.search(str(cause)):
        return [], 0.0  # e.g. a comm hook's own bug: the original error is the right one
    states, latest, silent_s = observe_peers(found, first)
    culprits, late, gone_but_arrived, elsewhere = [], [], [], []
    for rank in peers:
        culprit = Culprit(rank, states[rank], latest[rank], progress.key)
        record = latest[rank] or {}
        if _count(latest[rank], progress.key) < seq:
            culprits.append(culprit)
        elif (op and _count(record, progress.key) == seq
              and record.get("last_ops", {}).get(progress.key, op) != op):
            culprit.other_op = op
            elsewhere.append(culprit)
        elif rank in behind and states[rank] == "stuck":
            late.append(Culprit(rank, "late", first[rank], progress.key))
        elif states[rank] in ("gone", "exited", "raised"):
            gone_but_arrived.append(culprit)
    # A peer that arrived after the timeout is slow, not stuck; one that entered and then left
    # is to blame only if nobody is behind (peers that time out like this one exit too). One at
    # the same count in another collective comes before both: the ranks' code paths differ.
    return (culprits or elsewhere or late or gone_but_arrived), silent_s


def from_peer(peer: int, op: str, call: Callable[[], Any]) -> Any:
    """``call()``, a point-to-point transfer with global rank ``peer`` (a pipeline's send or
    receive); when the backend gives up on it, the error names ``peer`` and where it is.

    Point-to-point messages are not counted: the one peer of the transfer is the rank to blame,
    and its heartbeat says whether it is stuck, gone or exited.
    """
    start = time.monotonic()
    try:
        return call()
    except Exception as exc:
        found = tracker()
        if found is None or isinstance(exc, CollectiveTimeoutError) or not _PEER_TROUBLE.search(
                str(exc)):
            raise
        waited = time.monotonic() - start
        try:
            states, latest, silent_s = observe_peers(found, found.read([peer]))
        except Exception:  # noqa: BLE001 - the store's host may be the one gone
            raise _store_gone(found.rank, op, exc, waited) from exc
        culprit = Culprit(peer, states[peer], latest[peer])
        message = (f"rank {found.rank}: {op} failed after waiting {waited:.1f}s (step "
                   f"{found.step}): {culprit.describe(silent_s)}. Backend error: "
                   f"{_first_line(exc)}{_stacks_of([culprit])}")
        write_blame(found.rank, [culprit.as_dict()], message)
        raise CollectiveTimeoutError(message, op, [peer]) from exc


def describe_missing(missing: list[int], message: str, meeting: str = "") -> str:
    """Where ranks that missed a store meeting are (alive and where, exited, gone); blames them.

    For meetings through the store rather than a collective (the Checkpointer's): ``missing``
    are the ranks that never arrived, ``message`` the caller's error, to which this appends;
    ``meeting`` names the call they missed (the launcher prefers this evidence: a rank that
    skipped the call runs on into the next collective and names as stuck the ranks that wait
    in the meeting, a tie of one vote each otherwise).
    """
    found = tracker()
    if found is None or not missing:
        return message
    try:
        states, latest, silent_s = observe_peers(found, found.read(missing))
    except Exception:  # noqa: BLE001 - the store's host may be among the missing
        return message
    culprits = [Culprit(r, states[r], latest[r]) for r in missing]
    text = (f"{message} Where they are: " + "; ".join(c.describe(silent_s) for c in culprits)
            + "." + _stacks_of(culprits))  # the stacks of stuck ones, as a collective's says
    write_blame(found.rank, [{**c.as_dict(), "meeting": meeting} for c in culprits], text)
    return text


def _count(record: dict[str, Any] | None, key: str) -> int:
    return int(record.get("counts", {}).get(key, 0)) if record else 0


_WRAPPER = re.compile(r"^.*?(RuntimeError|DistBackendError|DistNetworkError): ")
_SOURCE = re.compile(r"\[[^\]]*\.(cc|cpp|h):\d+\] ")


def _first_line(exc: BaseException) -> str:
    """The backend's message in one line, without its C++ source path and sign-off."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # gloo's message comes wrapped in the future's callback error; keep the informative line.
    line = next((x for x in lines if _SOURCE.search(x)), lines[0] if lines else "")
    line = _SOURCE.sub("", _WRAPPER.sub("", line))
    return line.split(". This is typically")[0] or type(exc).__name__
