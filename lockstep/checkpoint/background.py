"""The disk half of an asynchronous save: encode, checksum, fsync and publish in a thread.

Each rank's thread writes its files into the staging directory, then leaves a marker there
(``.written-rank00001``, or ``.failed-rank00001`` holding the error). Rank 0's thread waits
for every other rank's marker, removes the markers and publishes (one rename), so ranks need no
collective while the loop trains: the process group stays the loop's alone. A failure is kept
and raised, on every rank, by the next ``save()``/``restore()``/``wait()``; the staging
directory is then dropped, and the previous checkpoint is untouched, as with a blocking save.

The thread first completes the snapshot's deferred copies (``deferred.py``), and publishes (or,
on other ranks, marks its files written) only once the thread that saved has checked that no
source changed meanwhile, at its next optimizer step or checkpoint call.

The thread is not a daemon: a process that returns from ``main`` right after ``save()`` finishes
the write before it exits. :func:`finish_on_sigterm` makes a SIGTERM (what the launcher sends to
stop workers) wait for it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from lockstep.checkpoint.deferred import DeferredCopy
from lockstep.checkpoint.liveness import LivenessLocks, is_gone
from lockstep.checkpoint.writing import write_files

__all__ = ["BackgroundSave", "finish_on_sigterm", "hold_liveness", "wait_for_writes"]

logger = logging.getLogger(__name__)

_WRITTEN = ".written-rank"
_FAILED = ".failed-rank"
_POLL_S = 0.005
# The writing thread's nice value: measured on the demo at world 2 on 2 busy cores (a save every
# step), 0.87 of the throughput without checkpoints against 0.81 at the default priority
# (docs/checkpoints-and-recovery.md, "Saving every step").
_WRITER_NICE = 19
# After a SIGTERM, rank 0 waits this long at most for the other ranks' files: they are being
# stopped too and finish their own writes first, but one that died will never write them.
_PEERS_AFTER_SIGTERM_S = 10.0
# How often rank 0 asks whether a rank it still waits for has died (``liveness.py``).
_LIVENESS_POLL_S = 0.05
_LIVENESS_BATCH = 16  # ranks asked about per look


def _in_turn(ranks: list[int], last: int, count: int) -> tuple[list[int], int]:
    """Up to ``count`` of the sorted ``ranks``, the first after ``last`` first (wrapping);
    and the last one taken."""
    after = [r for r in ranks if r > last] + [r for r in ranks if r <= last]
    taken = after[:count]
    return taken, (taken[-1] if taken else last)


def _marker(prefix: str, rank: int) -> str:
    return f"{prefix}{rank:05d}"


def _yield_to_training() -> None:
    """Give this thread the lowest CPU priority (Linux: a thread has its own nice value), so
    that where every core is busy training, the write takes what the training threads leave
    (the loop itself waits for it only at the next ``save()`` or optimizer step that needs it).
    Elsewhere, or where the system refuses, it keeps its priority."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)


class BackgroundSave:
    """One rank's write of one checkpoint, running in a thread.

    Args:
        staging: the staging directory (created by rank 0 before the save returned).
        final: the checkpoint directory it becomes.
        rank: this rank; world: the number of ranks saving.
        files: file name -> snapshot to encode (``snapshot.Snapshot.take``).
        publish: called by rank 0 once every rank has written (rename and prune).
        timeout: seconds rank 0 waits for the other ranks' markers.
        attempt: runs a callable and returns ``(result, error message or None)``.
        copy: receives each encoded file first (``replicas.MemoryCopies.keep``), if given.
        deferred: the snapshot's copies still to do (``Snapshot.take``), if any.
        alive: each rank's liveness file (:func:`hold_liveness`; ``None``: it has none), by
            which rank 0 stops waiting for a rank whose process has ended.
        split: the snapshot's blocks, whose tensors are each written as a storage of its own.
    """

    def __init__(
        self,
        staging: Path,
        final: Path,
        rank: int,
        world: int,
        files: Mapping[str, Any],
        publish: Callable[[], None],
        timeout: float,
        attempt: Callable[[Callable[[], Any]], tuple[Any, str | None]],
        copy: Callable[[str, bytes | memoryview], None] | None = None,
        deferred: DeferredCopy | None = None,
        alive: Sequence[str | None] = (),
        split: Collection[int] = (),
    ) -> None:
        self.staging, self.final, self.rank, self.world = staging, final, rank, world
        self._files, self._publish, self._attempt = files, publish, attempt
        self._copy = copy
        self._split = split  # the snapshot's blocks (Snapshot.blocks)
        self._alive = list(alive)
        self._asked = -1  # the last rank whose liveness rank 0 asked about
        self._deferred = deferred if deferred is not None else DeferredCopy([], [])
        self.error: str | None = None  # "rank r: message" of the first failure seen here
        # CPU seconds the writing thread used (encoding, checksums, writes), once it has ended.
        self.cpu_seconds: float | None = None
        self._timeout = timeout
        # For rank 0's wait for the other ranks: counted from its own check (see _run).
        self._deadline = float("inf")
        self._saver = threading.current_thread()  # the thread that saved: it raises our error
        self._thread = threading.Thread(
            target=self._run, name=f"lockstep-checkpoint-{final.name}", daemon=False
        )
        _PENDING.add(self)
        self._thread.start()

    def hurry(self, seconds: float) -> None:
        """Wait at most ``seconds`` more for the other ranks (the process is being stopped)."""
        self._deadline = min(self._deadline, time.monotonic() + seconds)

    def running(self) -> bool:
        """Whether the write (or, on rank 0, the wait for the others and the publish) goes on."""
        return self._thread.is_alive()

    def join(self) -> str | None:
        """Wait for the write (and, on rank 0, the publish); the error seen here, if any.

        Call it on the thread that saved: it first checks the deferred copy (see ``deferred.py``).
        """
        self._deferred.check()
        self._thread.join()
        self._deferred.remove_hooks()
        return self.error

    def _write(self) -> None:
        self._deferred.run()
        write_files(self.staging, self._files, self._copy, self._split)

    def _run(self) -> None:
        # Hand the GIL back at once: Thread.start() returns only once this thread has begun, and
        # the thread that saved would otherwise wait for the GIL until this one blocks, up to
        # the interpreter's switch interval (5 ms measured per save on the demo, issue #24).
        time.sleep(0)
        began = time.thread_time()
        try:
            self._run_write()
        finally:
            self.cpu_seconds = time.thread_time() - began

    def _run_write(self) -> None:
        _yield_to_training()
        _, error = self._attempt(self._write)
        changed = self._deferred.checked()  # nothing is published before the check passed
        error = changed or error
        self._deadline = min(self._deadline, time.monotonic() + self._timeout)
        self._files = {}  # the snapshot's buffers stay with the Snapshot for the next save
        if self.rank != 0:
            self._leave_marker(error)
            if error:
                self.error = f"rank {self.rank}: {error}"
                self._tell_if_orphaned()
            return
        if error:
            self.error = f"rank 0: {error}"
        else:
            self.error = self._wait_for_peers()
        if self.error is None:
            _, error = self._attempt(self._publish_now)
            self.error = f"rank 0: {error}" if error else None
        if self.error is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        else:
            logger.info("saved checkpoint %s", self.final)
        self._tell_if_orphaned()

    def _tell_if_orphaned(self) -> None:
        """Say an error nobody will raise: the thread that saved has ended (the script
        returned right after ``save()``), as a SIGTERM's wait says it (it was silent)."""
        if self.error is not None and not self._saver.is_alive():
            logger.warning("checkpoint %s was not saved (the program ended before its write "
                           "finished): %s", self.final, self.error)

    def _leave_marker(self, error: str | None) -> None:
        name = _marker(_FAILED, self.rank) if error else _marker(_WRITTEN, self.rank)
        tmp = self.staging / f"{name}.tmp"
        try:
            try:
                tmp.write_text(error or "")
            except OSError:  # e.g. the disk is full: an empty marker still says "failed"
                tmp.unlink(missing_ok=True)
                tmp.touch()
            os.replace(tmp, self.staging / name)
        except OSError as exc:  # rank 0 then times out naming this rank
            logger.warning("rank %d could not mark its checkpoint files written: %s",
                           self.rank, exc)

    def _wait_for_peers(self) -> str | None:
        waiting = set(range(1, self.world))
        next_look = time.monotonic() + _LIVENESS_POLL_S
        while waiting:
            told = self._look_for_markers(waiting)
            if told is not None:
                return told
            if waiting and time.monotonic() >= next_look:
                next_look = time.monotonic() + _LIVENESS_POLL_S
                # A few ranks per look (each is a lock request, to a server where the
                # directory is shared), in turn: after a SIGTERM few are still awaited.
                asked, self._asked = _in_turn(sorted(waiting), self._asked, _LIVENESS_BATCH)
                gone = [r for r in asked if self._gone(r)]
                # Marked just before its process ended? Look again before calling it gone.
                told = self._look_for_markers(waiting) if gone else None
                if told is not None:
                    return told
                gone = [r for r in gone if r in waiting]
                if gone:
                    return (
                        f"rank 0: rank(s) {gone} ended before writing their files into "
                        f"{self.staging} (killed or crashed: see their logs)"
                    )
            if waiting and time.monotonic() > self._deadline:
                return (
                    f"rank 0: rank(s) {sorted(waiting)} did not finish writing their files into "
                    f"{self.staging} in time (died, or the directory is not shared between the "
                    "ranks)"
                )
            if waiting:
                time.sleep(_POLL_S)
        return None

    def _gone(self, rank: int) -> bool:
        name = self._alive[rank] if rank < len(self._alive) else None
        return is_gone(self.final.parent, name, _LIVENESS)

    def _look_for_markers(self, waiting: set[int]) -> str | None:
        """Drop from ``waiting`` the ranks that marked their files written; the error of one
        that marked them failed, if any. One listing of the staging directory, not a look per
        rank: on a shared filesystem each look is a request to its server."""
        try:
            names = set(os.listdir(self.staging))
        except OSError:
            names = set()
        for rank in sorted(waiting):
            if _marker(_FAILED, rank) in names:
                failed = self.staging / _marker(_FAILED, rank)
                told = failed.read_text() or "could not write its files"
                return f"rank {rank}: {told}"
            if _marker(_WRITTEN, rank) in names:
                waiting.discard(rank)
        return None

    def _publish_now(self) -> None:
        for rank in range(1, self.world):
            (self.staging / _marker(_WRITTEN, rank)).unlink(missing_ok=True)
        self._publish()


_PENDING: weakref.WeakSet[BackgroundSave] = weakref.WeakSet()
# This process's liveness locks: POSIX locks belong to the process (see liveness.py).
_LIVENESS = LivenessLocks()


def hold_liveness(directory: Path, rank: int) -> str | None:
    """Let rank 0 tell, should this process die, that it will never write its part of an
    asynchronous save into ``directory``; the name to give rank 0 (``BackgroundSave(alive=)``).
    Rank 0 also clears the files of ended processes, at its first save into ``directory``."""
    return _LIVENESS.hold(directory, sweep=rank == 0)


def wait_for_writes(directory: Path) -> None:
    """Wait for this process's asynchronous writes into ``directory``, whichever
    ``Checkpointer`` started them: another object on the same directory must not read a
    checkpoint before it is published, nor clear its staging directory as a crash's leftover.
    Their errors stay with the object that started them (raised by its next call).
    """
    target = os.path.abspath(directory)
    for pending in list(_PENDING):
        if os.path.abspath(pending.final.parent) == target:
            pending.join()


def finish_on_sigterm() -> None:
    """On SIGTERM, finish the writes in flight, then die of SIGTERM as before.

    Installed only from the main thread and only over the default handler, so a handler of the
    user's (or torch's elastic agent) is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    busy: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        # Another SIGTERM while this one waits (a launcher and a scheduler both stopping the
        # job) must not wait too: run between two bytecodes of the wait, it could find the
        # thread's lock taken by the wait itself and never return (seen once in 150 runs).
        if busy:
            return
        busy.append(True)
        for pending in list(_PENDING):
            pending.hurry(_PEERS_AFTER_SIGTERM_S)
            error = pending.join()
            if error is not None:  # nothing will raise it now: say it before dying
                logger.warning("checkpoint %s was not saved (process stopped): %s",
                               pending.final, error)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
