"""The public checkpoint API: ``Checkpointer(directory, keep=3)`` with ``save`` and ``restore``.

Layout of ``directory``::

    step_000000001200/          one complete checkpoint per directory
        state.pt                models, optimizers, schedulers, scalers, samplers, step, extra
        rng-rank00000.pt        each rank's random generator states
        rng-rank00001.pt
        shard-rank00000.pt      each rank's pieces of sharded objects (lockstep.fsdp), if any
    .staging-step_000000001300/ a save in progress (or one cut short: never restored)
    .damaged-step_000000000900/ a checkpoint found damaged when pruning, set aside

A save writes every file into the staging directory (temporary file, fsync, rename), then all
ranks meet, then rank 0 renames the staging directory to its final name, so a checkpoint
directory exists complete or not at all. Every file carries a CRC-32 that restoring checks.
All ranks must see ``directory`` (one machine, or a shared filesystem).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.io import (
    CheckpointError,
    check_length,
    check_loadable,
    describe_os_error,
    encode,
    fsync_dir,
    read_verified,
    write_atomic,
)
from lockstep.checkpoint.meeting import check_agreement, meet
from lockstep.checkpoint.sharded import (
    SavedPieces,
    ShardFiles,
    saves_sharded,
    shard_file,
    shard_ranks,
    shard_writers,
)
from lockstep.checkpoint.state import (
    apply_state,
    capture_rng,
    object_state,
    restore_rng,
)

__all__ = ["CheckpointError", "Checkpointer", "Restored"]

logger = logging.getLogger(__name__)

_FORMAT = 1
_NAME = re.compile(r"^step_(\d+)$")
_STATE_FILE = "state.pt"
_DAMAGED_PREFIX = ".damaged-"
def _dir_name(step: int) -> str:
    return f"step_{step:012d}"


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _files(world: int, writers: list[int]) -> list[str]:
    """Every file of a checkpoint written by ``world`` ranks, with a shard file per rank in ``writers``."""
    return [_STATE_FILE, *map(_rng_file, range(world)), *map(shard_file, writers)]


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` resumed from.

    Attributes:
        step: the step passed to :meth:`Checkpointer.save`.
        epoch: the epoch passed to :meth:`Checkpointer.save`.
        extra: the ``extra`` dict passed to :meth:`Checkpointer.save`.
        path: the checkpoint directory read.
        world_size: the world size that wrote it.
    """

    step: int
    epoch: int
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path = Path()
    world_size: int = 1


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
        self.directory = Path(directory)
        self.keep = keep
        self.process_group = process_group
        self.timeout = timedelta(seconds=timeout)
        self._calls = 0
        # Checkpoint -> its files, for those written or verified by this object.
        self._known_intact: dict[Path, list[str]] = {}

    def _meet(self, call: str) -> None:
        """Fail, naming them, if some ranks never enter this call (e.g. saving on rank 0 only)."""
        if self._rank_and_world()[1] == 1:
            return
        self._calls += 1
        meet(self.directory, call, self._calls, self.timeout, self.process_group)

    def _check_agreement(self, call: str, step: int | None = None) -> None:
        """Raise on every rank if the ranks passed different directories or steps."""
        if self._rank_and_world()[1] == 1:
            return
        check_agreement(call, self._gather((str(self.directory), step)))

    def _check_directory(self) -> None:
        """Refuse a directory that is a file, or a single checkpoint (one level too deep)."""
        where = self.directory
        if where.exists() and not where.is_dir():
            raise CheckpointError(
                f"checkpoint directory {where} is a file, not a directory. Pass the folder that "
                "holds (or will hold) the step_* checkpoints."
            )
        if _NAME.match(where.name) or (where / _STATE_FILE).exists():
            raise CheckpointError(
                f"{where} is a single checkpoint, not a checkpoint directory: pass its parent "
                f"{where.parent} (the folder that holds the step_* checkpoints)."
            )

    # -- ranks -------------------------------------------------------------------------------

    def _rank_and_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (also a barrier); a world of one needs no group."""
        if self._rank_and_world()[1] == 1:
            return [value]
        out: list[Any] = [None] * self._rank_and_world()[1]
        dist.all_gather_object(out, value, group=self.process_group)
        return out

    def _agree(self, what: str, error: str | None, cleanup: Callable[[], None] | None = None):
        """Raise the same error on every rank if any rank failed at ``what``."""
        failures = [(rank, err) for rank, err in enumerate(self._gather(error)) if err]
        if not failures:
            return
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
        **objects: Any,
    ) -> Path:
        """Write a checkpoint for ``step``; call on every rank.

        Args:
            step: the step to resume at (typically the number of optimizer steps done).
            epoch: the current epoch, given back by :meth:`restore`.
            extra: your own plain values (numbers, strings, tensors, lists, dicts).
            **objects: name -> object with ``state_dict()``, e.g. ``model=model``; one with
                ``sharded_state_dict()`` is written one piece per rank (see ``sharded``).

        Returns:
            The directory of the new checkpoint.

        Raises:
            CheckpointError: on every rank, naming the rank and file, if any rank could not
                write (directory not writable, disk full...); previous checkpoints are kept.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._meet(f"save(step={step})")
        self._check_agreement(f"save(step={step})", step)
        rank, world = self._rank_and_world()
        final = self.directory / _dir_name(step)
        staging = self.directory / f".staging-{final.name}"
        error = self._attempt(lambda: self._prepare(staging))[1] if rank == 0 else None
        self._agree(f"saving checkpoint {final}", error)
        for obj in objects.values():
            consolidate = getattr(obj, "consolidate_state_dict", None)
            if callable(consolidate):
                consolidate(to=0)  # sharded optimizers (ZeRO) gather their state on rank 0 first

        sharded = sorted(name for name, obj in objects.items() if saves_sharded(obj))
        writers = shard_writers([objects[name] for name in sharded], self._gather)  # replicas skip

        def write() -> None:
            if rank == 0:
                meta = {"format": _FORMAT, "step": step, "epoch": int(epoch), "world_size": world,
                        "sharded": sharded, "shard_ranks": writers}
                whole = {n: o for n, o in objects.items() if n not in sharded}
                self._write_state(staging, meta, dict(extra or {}), whole)
            if rank in writers:
                pieces = {name: objects[name].sharded_state_dict() for name in sharded}
                check_loadable(pieces, f"rank {rank}'s sharded_state_dict()")
                write_atomic(staging / shard_file(rank), encode(pieces))
            write_atomic(staging / _rng_file(rank), encode(capture_rng()))

        def drop_staging() -> None:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)

        self._agree(f"saving checkpoint {final}", self._attempt(write)[1], drop_staging)
        files = _files(world, writers)
        error = self._attempt(lambda: self._publish(staging, final, files))[1] if rank == 0 else None
        self._agree(f"saving checkpoint {final}", error, drop_staging)
        if rank == 0:
            logger.info("saved checkpoint %s", final)
        return final

    def _prepare(self, staging: Path) -> None:
        self._check_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".staging-*"):
            shutil.rmtree(stale, ignore_errors=True)  # saves cut short by a crash
        for replaced in self.directory.glob(".replaced-*"):
            # A crash between moving a re-saved step aside and publishing its new copy: put
            # the old copy back when no new one made it, otherwise it is garbage.
            final = self.directory / replaced.name[len(".replaced-"):]
            if final.exists():
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                os.replace(replaced, final)
        staging.mkdir()

    def _write_state(
        self, staging: Path, meta: dict, extra: dict, objects: Mapping[str, Any]
    ) -> None:
        payload = {"meta": meta, "extra": extra, "objects": {}}
        for name, obj in objects.items():
            payload["objects"][name] = object_state(name, obj)
        check_loadable(extra, "extra")
        for name, state in payload["objects"].items():
            check_loadable(state, f"{name}.state_dict()")
        write_atomic(staging / _STATE_FILE, encode(payload))

    def _publish(self, staging: Path, final: Path, files: list[str]) -> None:
        fsync_dir(staging)
        if final.exists():
            # Re-saving a step (its earlier copy was damaged): move it aside, never overwrite.
            trash = self.directory / f".replaced-{final.name}"
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)
        fsync_dir(self.directory)
        self._known_intact[final] = files
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        """Keep ``newest`` and the next ``keep - 1`` intact checkpoints, newest step first.

        The checkpoint just written is never deleted, whatever its step (a fresh start after
        damaged checkpoints saves a lower step than theirs). Damaged checkpoints do not count as
        kept: they are moved aside with a warning naming them.
        """
        kept = 1
        for path in self._complete_dirs():
            if path == newest:
                continue
            if kept >= self.keep:
                shutil.rmtree(path, ignore_errors=True)
            elif self._is_intact(path):
                kept += 1
            else:
                self._set_aside(path)

    def _is_intact(self, path: Path) -> bool:
        """Whether ``path`` reads back intact.

        Each checkpoint is read in full (checksums) at most once per process; one this object
        wrote or already verified gets a cheap check instead: every file present, none truncated.
        """
        try:
            files = self._known_intact.get(path)
            if files is None:
                self._verify(path)
            else:
                for name in files:
                    check_length(path / name)
        except CheckpointError:
            self._known_intact.pop(path, None)
            return False
        return True

    def _set_aside(self, path: Path) -> None:
        aside = self.directory / f"{_DAMAGED_PREFIX}{path.name}"
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(path, aside)
        except OSError as exc:  # pruning must not fail a save that succeeded
            logger.warning("could not move damaged checkpoint %s aside: %s", path, exc)
            return
        message = (
            f"checkpoint {path} is damaged and cannot be restored: moved it aside to {aside} "
            "so that it no longer counts among the kept ones. Delete it when you no longer need it."
        )
        warnings.warn(message, stacklevel=4)
        logger.warning(message)

    # -- restore -----------------------------------------------------------------------------

    def _complete_dirs(self) -> list[Path]:
        """Published checkpoint directories, newest first (not yet verified)."""
        if not self.directory.is_dir():
            return []
        found = [
            (int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))
        ]
        return [p for _, p in sorted(found, reverse=True)]

    def _verify(self, path: Path) -> dict[str, Any]:
        state = read_verified(path / _STATE_FILE)
        meta = state.get("meta", {}) if isinstance(state, dict) else {}
        if meta.get("format") != _FORMAT:
            raise CheckpointError(f"{path / _STATE_FILE} has unknown format {meta.get('format')!r}")
        world = meta.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{path / _STATE_FILE} records no valid world_size ({world!r})")
        files = _files(world, shard_ranks(meta))
        for name in files[1:]:
            read_verified(path / name)
        self._known_intact[path] = files
        return state

    def latest(self) -> Path | None:
        """The newest checkpoint that reads back intact; damaged ones are skipped with a warning.

        Needs no other rank (no collectives), so it can be called anywhere.
        """
        found = self._newest_intact()
        return found[0] if found else None

    def _newest_intact(self) -> tuple[Path, dict[str, Any]] | None:
        for path in self._complete_dirs():
            try:
                return path, self._verify(path)
            except CheckpointError as exc:
                warnings.warn(f"skipping damaged checkpoint {path}: {exc}", stacklevel=3)
                logger.warning("skipping damaged checkpoint %s: %s", path, exc)
        return None

    def _find(self) -> tuple[Path, dict[str, Any]] | None:
        self._check_directory()
        return self._newest_intact()

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
        rank, world = self._rank_and_world()
        found, error = self._attempt(self._find) if rank == 0 else (None, None)
        choice, error = self._gather((found[0].name if found else None, error))[0]
        if error:
            raise CheckpointError(f"looking for a checkpoint in {self.directory} failed: {error}")
        if choice is None:
            return None
        path = self.directory / choice
        cached = found[1] if found else None
        result, error = self._attempt(lambda: self._apply(path, cached, rank, world, objects))
        self._agree(f"restoring checkpoint {path}", error)
        if rank == 0:
            logger.info("resumed from checkpoint %s", path)
        return result

    def _apply(
        self, path: Path, state: dict | None, rank: int, world: int, objects: Mapping[str, Any]
    ) -> Restored:
        state = state if state is not None else read_verified(path / _STATE_FILE)
        saved, meta = state["objects"], state["meta"]
        sharded = set(meta.get("sharded", ()))
        absent = sorted(set(objects) - set(saved) - sharded)
        if absent:
            raise CheckpointError(
                f"{path} has no {', '.join(map(repr, absent))}; it holds {sorted({*saved, *sharded})}. "
                "Pass the names used when saving."
            )
        files = ShardFiles(path, meta["world_size"], shard_ranks(meta))
        for name, obj in objects.items():
            if name not in sharded:
                apply_state(name, obj, saved[name], str(path / _STATE_FILE))
            elif callable(getattr(obj, "load_sharded_state_dict", None)):
                obj.load_sharded_state_dict(SavedPieces(files, name))
            else:
                raise CheckpointError(
                    f"{path} holds {name!r} sharded (one piece per rank); a "
                    f"{type(obj).__name__} cannot load that. Pass lockstep.fsdp.ModelState(model) "
                    "or OptimizerState(model, optimizer), which load it into a sharded or plain model."
                )
        if rank < meta["world_size"]:
            restore_rng(read_verified(path / _rng_file(rank)))
        else:
            logger.warning(
                "rank %d: %s was written by %d ranks, so this rank's random generators start "
                "fresh", rank, path, meta["world_size"],
            )
        return Restored(
            step=meta["step"], epoch=meta["epoch"], extra=state["extra"], path=path,
            world_size=meta["world_size"],
        )
