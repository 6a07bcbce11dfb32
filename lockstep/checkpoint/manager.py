"""The public checkpoint API: ``Checkpointer(directory, keep=3)`` with ``save`` and ``restore``.

Layout of ``directory``::

    step_000000001200/          one complete checkpoint per directory
        state.pt                models, optimizers, schedulers, scalers, samplers, step, extra
        rng-rank00000.pt        each rank's random generator states
        rng-rank00001.pt
        shard-rank00000.pt      each rank's pieces of sharded objects (lockstep.fsdp), if any
    .staging-step_000000001300/ a save in progress (or one cut short: never restored)
    .damaged-step_000000000900/ a checkpoint found damaged when pruning, set aside
    .lockstep-alive/<host>-<pid> locked by each process while it lives (asynchronous saves,
                                several ranks): rank 0 stops waiting for a dead rank at once

A save writes every file into the staging directory (temporary file, fsync, rename), then all
ranks meet, then rank 0 renames the staging directory to its final name, so a checkpoint
directory exists complete or not at all. Every file carries a CRC-32 that restoring checks.
All ranks must see ``directory`` (one machine, or a shared filesystem).

This module is where the ranks act together; file names, listing and pruning are in
``directory.py``, writing in ``writing.py``, verifying and loading in ``loading.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.background import (
    BackgroundSave,
    finish_on_sigterm,
    hold_liveness,
    wait_for_writes,
)
from lockstep.checkpoint.budget import SaveBudget, check_share
from lockstep.checkpoint.deferred import DeferredCopy, stepped_storages, stepping_optimizers
from lockstep.checkpoint.directory import (
    check_directory,
    checkpoint_files,
    dir_name,
    prune,
)
from lockstep.checkpoint.io import CheckpointError, describe_os_error
from lockstep.checkpoint.loading import IntactCheckpoints, load_into
from lockstep.checkpoint.meeting import check_agreement, meet
from lockstep.checkpoint.replicas import MemoryCopies, default_memory_root
from lockstep.checkpoint.restoring import (
    broadcast_from,
    memory_copy,
    replicate_to_peer,
    restore_from_memory,
    ring_exchange,
)
from lockstep.checkpoint.sharded import saves_sharded, shard_writers, writes_shard
from lockstep.checkpoint.snapshot import Snapshot
from lockstep.checkpoint.writing import (
    collect_rank_files,
    prepare_staging,
    publish,
    staging_dir,
    write_files,
)
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.small_gather import all_gather_small

__all__ = ["CheckpointError", "Checkpointer", "Restored"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` resumed from.

    Attributes:
        step: the step passed to :meth:`Checkpointer.save`.
        epoch: the epoch passed to :meth:`Checkpointer.save`.
        extra: the ``extra`` dict passed to :meth:`Checkpointer.save`.
        path: the checkpoint directory read (on disk, also when read from memory).
        world_size: the world size that wrote it.
        source: ``"disk"``, or ``"memory"`` when its bytes came from the shared-memory copies.
    """

    step: int
    epoch: int
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path = Path()
    world_size: int = 1
    source: str = "disk"  # or "memory": read from the shared-memory copies (``memory=True``)


class Checkpointer:
    """Save and restore everything a run needs to continue exactly where it stopped.

    Call :meth:`save` and :meth:`restore` on **every** rank with the same arguments: ranks meet
    inside them. Objects are passed by name; anything with ``state_dict()`` and
    ``load_state_dict()`` works (models wrapped or not, optimizers, LR schedulers, gradient
    scalers, samplers). Each rank's Python, NumPy and torch (CPU and CUDA) RNG states are saved
    and restored too.

    Args:
        directory: where checkpoints live; created if missing. Every rank must see it.
        keep: how many complete checkpoints to keep; older ones are deleted after a save.
        process_group: the group whose ranks save together (``None``: the default group).
        timeout: seconds a rank waits for the others to enter :meth:`save`/:meth:`restore`
            before failing with the names of those that did not (the default matches the
            process group's 10 minutes, after which the save's collectives would fail anyway).
        blocking: the default of :meth:`save`'s ``blocking``: ``False`` (the default) makes
            every save asynchronous (a snapshot in host memory, written by a background
            thread); ``True`` writes before ``save()`` returns.
        memory: also keep each rank's files in shared memory (tmpfs) and restore from there
            when they are all found (see ``replicas.py``); costs tmpfs memory equal to two
            checkpoints' files. Off for models whose state does not fit there twice.
        memory_dir: where those copies live (default ``/dev/shm/lockstep-<hash>``).
        when_busy: what an asynchronous :meth:`save` does while the previous one is still
            being written on some rank: ``"wait"`` for it, or ``"skip"`` this save (nothing is
            written for that step; for saving every step at the pace the disk allows).
        defer_copy: let an asynchronous save copy the parameters and optimizer state of the
            optimizers it is given after it returns, overlapping the next forward/backward; the
            copy is completed before their next ``step()``, and a save whose parameters were
            changed in place meanwhile fails (see ``deferred.py``). ``False``: copy everything
            before ``save()`` returns, for loops that write parameters outside ``step()``
            between a save and the next step.
        max_overhead: pace asynchronous saves so that they take at most this share of the
            loop's time (e.g. ``0.05``: 5%), for a loop that calls :meth:`save` every step
            whatever a save costs: a call made sooner than the last saves' cost allows returns
            at once without meeting the other ranks (they agree on the next save's step at
            each save), and one that finds the previous save still being written is skipped
            (whatever ``when_busy`` says). A save's cost is the training thread's time in ``save()`` plus
            the writing thread's CPU time (see ``budget.py``); :attr:`last_skipped` tells
            whether a call saved. ``None`` (the default): every call saves. Needs asynchronous
            saves; a ``save(blocking=True)`` is never skipped.

    Example::

        ckpt = lockstep.Checkpointer("checkpoints", keep=3)
        resumed = ckpt.restore(model=model, optimizer=optimizer, sampler=sampler)
        start = resumed.step if resumed else 0
        for step in range(start, total_steps):
            train_one_step()
            if (step + 1) % 100 == 0:
                ckpt.save(step + 1, model=model, optimizer=optimizer, sampler=sampler)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        *,
        process_group: Any = None,
        timeout: float = 600.0,
        blocking: bool = False,
        memory: bool = False,
        memory_dir: str | os.PathLike | None = None,
        when_busy: str = "wait",
        defer_copy: bool = True,
        max_overhead: float | None = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"directory must be a path (str or pathlib.Path), got {type(directory).__name__} "
                f"{directory!r}"
            )
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be a positive int (checkpoints kept), got {keep!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(
                f"timeout must be a number of seconds (int or float), got "
                f"{type(timeout).__name__} {timeout!r}, e.g. Checkpointer(dir, timeout=600)"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True or False, got {blocking!r}")
        if not isinstance(defer_copy, bool):
            raise TypeError(f"defer_copy must be True or False, got {defer_copy!r}")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f'when_busy must be "wait" or "skip", got {when_busy!r}')
        self._budget: SaveBudget | None = None
        if max_overhead is not None:
            if blocking:
                raise ValueError(
                    "max_overhead paces asynchronous saves, but blocking=True makes every save "
                    "blocking (never skipped): pass blocking=False, or drop max_overhead"
                )
            self._budget = SaveBudget(check_share(max_overhead))
        self.max_overhead = self._budget.share if self._budget is not None else None
        self._paced_in: Any = None  # the group whose ranks agreed on the budget's next step
        # Whether the last save() call was skipped (when_busy="skip" or max_overhead).
        self.last_skipped = False
        self.when_busy = when_busy
        self.blocking = blocking
        self.defer_copy = defer_copy
        # Absolute now: a background write, or a restore after os.chdir, uses the directory the
        # caller named, not one of the same name elsewhere.
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.process_group = process_group
        self.timeout = timedelta(seconds=timeout)
        self._calls = 0
        # The group this object's calls were counted in, and the one the save in flight was
        # made in: lockstep.Survivors replaces the default group when the world changes.
        self._met_in: Any = None
        self._saved_in: Any = None
        # The checkpoints written or verified by this object, with their files.
        self._intact = IntactCheckpoints()
        self._snapshot = Snapshot()  # host buffers of asynchronous saves, reused
        self._pending: BackgroundSave | None = None  # the asynchronous save in flight
        # A save in flight finished on this rank while another rank's was still being written
        # (its final directory and error): reported at the next settling.
        self._finished: tuple[Path | None, str | None] | None = None
        self._memory: MemoryCopies | None = None
        if memory:
            root = Path(memory_dir) if memory_dir is not None else default_memory_root(
                self.directory)
            self._memory = MemoryCopies(root)
        self._unreplicated: int | None = None  # the step whose files no peer holds yet

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by this rank's snapshot for asynchronous saves (0 before any)."""
        return self._snapshot.nbytes

    def wait(self) -> None:
        """Wait until the last asynchronous :meth:`save` is on disk; call on every rank.

        Raises:
            CheckpointError: on every rank, naming the rank and file, if writing it failed;
                the previous checkpoint is then the newest one.
        """
        self._settle()
        self._replicate()

    def _replicate(self) -> None:
        """With ``memory=True``, copy the last save's files to the next rank's machine."""
        step, self._unreplicated = self._unreplicated, None
        rank, world = self._rank_and_world()
        if self._memory is None or step is None or world == 1:
            return
        exchange = partial(ring_exchange, rank=rank, group=self.process_group)
        replicate_to_peer(self._memory, step, rank, world, self._gather, exchange)

    def _group(self) -> Any:
        """The group saving together now (the default group: whichever is current)."""
        if self.process_group is not None or not dist.is_initialized():
            return self.process_group
        return dist.group.WORLD

    def _settle(self) -> None:
        """Finish the save in flight and raise its error, if any, on every rank.

        A save made in a world that has changed since (``lockstep.Survivors`` re-formed the
        group after a failure) is finished if its files are all written, else dropped with a
        warning: a dead rank never writes its part, and the previous checkpoint stays newest.
        """
        final, error = self._finish_pending()
        self._raise_failures(final, self._gather(error))

    def _finish_pending(self) -> tuple[Path | None, str | None]:
        """This rank's part of :meth:`_settle`: wait for the save in flight here; its final
        directory (``None``: none was in flight) and the error seen here."""
        if self._finished is not None:  # finished before a skipped save: not reported yet
            done, self._finished = self._finished, None
            return done
        pending, self._pending = self._pending, None
        if pending is None:
            return None, None
        moved = self._saved_in is not self._group()
        if moved:
            pending.hurry(0.0)  # a dead peer's files never come
            self._unreplicated = None  # the ring it was to be copied around is gone too
        error = pending.join()
        self._charge(pending)
        if moved and error is not None:
            logger.warning("checkpoint %s was dropped: the world changed while it was written "
                           "(%s); the previous checkpoint is the newest", pending.final, error)
            error = None
        return pending.final, error

    def _charge(self, pending: BackgroundSave) -> None:
        """Tell the budget (``max_overhead``) what the writing of ``pending`` cost, once ended."""
        if self._budget is not None and pending.cpu_seconds is not None:
            self._budget.written(pending, pending.cpu_seconds)

    @staticmethod
    def _raise_failures(final: Path | None, errors: list[str | None]) -> None:
        """Raise the first failure among every rank's ``errors`` (the same on every rank)."""
        # The failing rank's own message (it names the file) over what others saw of it.
        own = [e for r, e in enumerate(errors) if e and e.startswith(f"rank {r}:")]
        failure = next(iter(own), next((e for e in errors if e), None))
        if failure is not None and final is not None:
            raise CheckpointError(f"saving checkpoint {final} failed on {failure}")
        if failure is not None:  # another rank had a save in flight that this one did not
            raise CheckpointError(f"an asynchronous checkpoint save failed on {failure}")

    def _meet(self, call: str) -> None:
        """Fail, naming them, if some ranks never enter this call (e.g. saving on rank 0 only)."""
        if self._rank_and_world()[1] == 1:
            return
        group = self._group()
        if group is not self._met_in:  # a new world: its members count their calls afresh
            self._met_in, self._calls = group, 0
        self._calls += 1
        meet(self.directory, call, self._calls, self.timeout, self.process_group)

    def _check_agreement(self, call: str, step: int | None = None, busy: bool = False) -> bool:
        """Raise on every rank if the ranks passed different directories or steps; return
        whether any rank said it was ``busy`` (one collective for both)."""
        if self._rank_and_world()[1] == 1:
            return busy
        seen = self._gather((str(self.directory), step, busy))
        check_agreement(call, [(where, at) for where, at, _ in seen])
        return any(flag for _, _, flag in seen)

    # -- ranks -------------------------------------------------------------------------------

    def _rank_and_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (also a barrier); a world of one needs no group."""
        if self._rank_and_world()[1] == 1:
            return [value]
        # A rank that dies after the meeting (between two agreements) is named, not anonymous.
        return hang.run(group_progress(self.process_group), "Checkpointer agreement",
                        lambda: all_gather_small(value, self.process_group))

    def close(self) -> None:
        """Wait for the save in flight and remove this rank's shared-memory copies, if any;
        call on every rank."""
        self._settle()
        if self._memory is not None:
            self._memory.clear()

    def _agree(self, what: str, error: str | None, cleanup: Callable[[], None] | None = None,
               value: Any = None) -> list[Any]:
        """Raise the same error on every rank if any rank failed at ``what``; else every
        rank's ``value`` (gathered in the same collective)."""
        seen = self._gather((error, value))
        failures = [(rank, err) for rank, (err, _) in enumerate(seen) if err]
        if not failures:
            return [got for _, got in seen]
        if cleanup is not None:
            cleanup()
        rank, err = failures[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {err}")

    @staticmethod
    def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
        try:
            return fn(), None
        except CheckpointError as exc:
            return None, str(exc)
        except OSError as exc:
            return None, describe_os_error(exc, Path(exc.filename or "checkpoint directory"))
        except Exception as exc:
            logger.debug("checkpoint step failed", exc_info=True)
            return None, f"{type(exc).__name__}: {exc}"

    # -- save --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int = 0,
        extra: Mapping[str, Any] | None = None,
        blocking: bool | None = None,
        **objects: Any,
    ) -> Path:
        """Write a checkpoint for ``step``; call on every rank.

        By default (``blocking=False``) the save is asynchronous: it returns once a copy of the
        state is in host memory (see :attr:`snapshot_bytes`; the parameters and state of the
        optimizers passed are copied while the loop runs on, before their next ``step()``: see
        ``defer_copy``) and a thread writes it; the
        checkpoint directory appears when every rank has written. The next ``save()``, :meth:`wait`,
        ``restore()``, the end of the process and a SIGTERM wait for it; an error in the write is
        raised by the next ``save()``/``wait()``/``restore()``. ``blocking=True`` returns only
        once it is on disk, raising any error itself.

        Args:
            step: the step to resume at (typically the number of optimizer steps done).
            epoch: the current epoch, given back by :meth:`restore`.
            extra: your own plain values (numbers, strings, tensors, lists, dicts).
            **objects: name -> object with ``state_dict()``, e.g. ``model=model``; one with
                ``sharded_state_dict()`` is written one piece per rank (see ``sharded``).
            blocking: write before returning (``False``: in a background thread); ``None``:
                the ``blocking`` given to the constructor (``False`` unless told otherwise).

        Returns:
            The directory of the new checkpoint (asynchronous: where it will appear; with
            ``when_busy="skip"``, a skipped save's directory never appears).

        Raises:
            CheckpointError: on every rank, naming the rank and file, if any rank could not
                write (directory not writable, disk full...); previous checkpoints are kept.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if blocking is None:
            blocking = self.blocking
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True, False or None, got {blocking!r}")
        budget = self._budget
        if budget is not None and self._group() is not self._paced_in:
            budget.forget()  # a new world (lockstep.Survivors): its members meet afresh
            self._paced_in = self._group()
        if budget is not None and not blocking and budget.passes_over(step):
            self.last_skipped = True  # too soon for max_overhead: every rank agreed so before
            return self.directory / dir_name(step)
        started = budget.now() if budget is not None else 0.0
        call = f"save(step={step})"
        self._meet(call)
        may_skip = not blocking and (self.when_busy == "skip" or budget is not None)
        pending = self._pending
        if pending is not None and not pending.running():
            self._charge(pending)
        busy = may_skip and pending is not None and pending.running()
        # The save in flight here is finished first (unless it is still being written and this
        # save may be skipped), so that one collective agrees on the directory and step, on
        # whether any rank is busy, on how the previous save went and, with max_overhead, on
        # the step of the next save.
        finished = (None, None) if busy else self._finish_pending()
        proposal = budget.propose(step) if budget is not None else None
        names = sorted(objects)
        seen = self._gather((str(self.directory), step, names, busy, finished[1], proposal))
        skip = may_skip and any(flag for _, _, _, flag, _, _ in seen)
        self.last_skipped = skip
        if finished[0] is not None and skip:
            self._finished = finished  # reported by the next save, wait() or restore()
        try:
            check_agreement(call, [(where, at) for where, at, *_ in seen],
                            [given for _, _, given, *_ in seen])
        except CheckpointError:
            if finished[0] is not None:
                self._finished = finished  # the previous save's outcome is not lost
            raise
        if budget is not None:
            budget.agree([planned for *_, planned in seen])
        if skip:
            logger.debug("skipped checkpoint of step %d: the previous save is still written or "
                         "the next one is not due (max_overhead)", step)
            return self.directory / dir_name(step)
        self._raise_failures(finished[0], [error for *_, error, _ in seen])
        self._replicate()  # the previous save's files, now written, to the next rank's memory
        wait_for_writes(self.directory)  # another Checkpointer's save into the same directory
        rank, world = self._rank_and_world()
        final = self.directory / dir_name(step)
        staging = staging_dir(final)
        error = (self._attempt(lambda: prepare_staging(self.directory, staging))[1]
                 if rank == 0 else None)
        for obj in objects.values():
            consolidate = getattr(obj, "consolidate_state_dict", None)
            if callable(consolidate):
                consolidate(to=0)  # sharded optimizers (ZeRO) gather their state on rank 0 first

        sharded = sorted(name for name, obj in objects.items() if saves_sharded(obj))
        staging_error: str | None = None
        if sharded or blocking:
            # Whether the staging directory is there (a blocking save writes into it next),
            # and who writes a shard file (replicas skip), agreed in one collective.
            writes = writes_shard([objects[name] for name in sharded])
            writers = shard_writers(self._agree(f"saving checkpoint {final}", error, value=writes))
        else:
            # Nothing sharded, nothing written before the next agreement: rank 0's staging
            # error travels with the snapshot's (one collective fewer per save).
            writers, staging_error = [], error

        optimizers = stepping_optimizers(objects) if self.defer_copy and not blocking else []
        deferred: list[DeferredCopy] = []

        def collect() -> dict[str, Any]:
            files = collect_rank_files(rank, world, step, epoch, extra, objects, sharded, writers)
            if blocking:
                return files
            # Parameters and optimizer state are copied later: only a step changes them.
            snapshot, later = self._snapshot.take(files, stepped_storages(optimizers), step)
            deferred.append(later)
            return snapshot

        def drop_staging() -> None:
            for later in deferred:
                later.run()  # CUDA copies in flight must land before the buffers are reused
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)

        copy = memory_copy(self._memory, step, rank) if self._memory is not None else None
        files, error = self._attempt(collect)
        error = staging_error or error
        if blocking and not error:
            error = self._attempt(lambda: write_files(staging, files, copy))[1]
        # So that rank 0 need not wait long for this rank's files should its process end.
        alive = None if blocking or world == 1 else hold_liveness(self.directory, rank)
        # A state that cannot be saved is reported now, asynchronous or not.
        alive_names = self._agree(f"saving checkpoint {final}", error, drop_staging, alive)
        self._unreplicated = step if self._memory is not None else None
        if not blocking:
            finish_on_sigterm()
            publish_all = partial(self._publish, staging, final, checkpoint_files(world, writers))
            later = deferred[0]
            later.watch(optimizers)
            self._saved_in = self._group()
            self._pending = BackgroundSave(
                staging, final, rank, world, files, publish_all,
                self.timeout.total_seconds(), self._attempt, copy, later, alive_names,
                self._snapshot.blocks(),
            )
            if budget is not None:
                budget.taken(self._pending, budget.now() - started)
            return final
        files_list = checkpoint_files(world, writers)
        error = (self._attempt(lambda: self._publish(staging, final, files_list))[1]
                 if rank == 0 else None)
        self._agree(f"saving checkpoint {final}", error, drop_staging)
        if budget is not None:  # a blocking save costs the loop all of its time
            budget.taken(final, budget.now() - started)
            budget.written(final, 0.0)
        if rank == 0:
            logger.info("saved checkpoint %s", final)
        return final

    def _publish(self, staging: Path, final: Path, files: list[str]) -> None:
        publish(self.directory, staging, final)
        self._intact.remember(final, files)
        prune(self.directory, final, self.keep, self._intact.is_intact)

    # -- restore -----------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest checkpoint that reads back intact; damaged ones are skipped with a warning.

        Needs no other rank (no collectives), so it can be called anywhere.
        """
        # Saves in flight (this object's or another's) first; errors come with the next save().
        wait_for_writes(self.directory)
        found = self._intact.newest(self.directory)
        return found[0] if found else None

    def _find(self) -> tuple[Path, dict[str, Any]] | None:
        check_directory(self.directory)
        wait_for_writes(self.directory)  # rank 0's write is published after every rank's
        return self._intact.newest(self.directory)

    def restore(self, **objects: Any) -> Restored | None:
        """Load the newest intact checkpoint into ``objects``; call on every rank.

        Args:
            **objects: the same names passed to :meth:`save`, e.g. ``model=model``.

        Returns:
            A :class:`Restored` (step, epoch, extra, path), or ``None`` when there is no
            checkpoint yet, in which case nothing was changed.

        Raises:
            CheckpointError: on every rank: the checkpoint lacks a requested name, holds another
                model's weights (missing/unexpected keys listed), or could not be read.
        """
        self._meet("restore()")
        self._check_agreement("restore()")
        self._settle()
        # Another Checkpointer's save in flight into this directory (it publishes only once
        # its deferred copy is checked, here): the memory copies follow the disk's newest.
        wait_for_writes(self.directory)
        rank = self._rank_and_world()[0]
        if self._memory is not None:
            broadcast = partial(broadcast_from, world=self._rank_and_world()[1],
                                group=self.process_group)
            from_memory = restore_from_memory(
                self._memory, self.directory, rank, objects, self._gather, broadcast,
                self._attempt)
            if from_memory is not None:
                path, state = from_memory
                meta = state["meta"]
                return Restored(step=meta["step"], epoch=meta["epoch"], extra=state["extra"],
                                path=path, world_size=meta["world_size"], source="memory")
        found, error = self._attempt(self._find) if rank == 0 else (None, None)
        choice, error = self._gather((found[0].name if found else None, error))[0]
        if error:
            raise CheckpointError(f"looking for a checkpoint in {self.directory} failed: {error}")
        if choice is None:
            return None
        path = self.directory / choice
        cached = found[1] if found else None
        result, error = self._attempt(lambda: self._apply(path, cached, rank, objects))
        self._agree(f"restoring checkpoint {path}", error)
        if rank == 0:
            logger.info("resumed from checkpoint %s", path)
        return result

    def _apply(
        self, path: Path, state: dict | None, rank: int, objects: Mapping[str, Any]
    ) -> Restored:
        state = load_into(path, state, rank, objects)
        meta = state["meta"]
        return Restored(
            step=meta["step"], epoch=meta["epoch"], extra=state["extra"], path=path,
            world_size=meta["world_size"],
        )
