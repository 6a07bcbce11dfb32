"""What a checkpoint directory holds: file names, the list of checkpoints, and which are kept.

A checkpoint is a folder ``step_<12 digits>`` holding ``state.pt``, one ``rng-rank<5 digits>.pt``
per rank and, for sharded objects, one shard file per rank (see the layout in ``manager.py``).
After a save, only the newest ``keep`` intact checkpoints stay; a damaged one is moved aside to
``.damaged-step_…`` with a warning, so that it no longer counts among the kept ones.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

from lockstep.checkpoint.io import CheckpointError
from lockstep.checkpoint.sharded import shard_file

__all__ = [
    "FORMAT",
    "STATE_FILE",
    "check_directory",
    "checkpoint_files",
    "complete_dirs",
    "dir_name",
    "prune",
    "rng_file",
]

logger = logging.getLogger(__name__)

FORMAT = 1  # the version written in every state.pt; restoring refuses another
STATE_FILE = "state.pt"
_NAME = re.compile(r"^step_(\d+)$")
_DAMAGED_PREFIX = ".damaged-"


def dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step_{step:012d}"


def rng_file(rank: int) -> str:
    """The file holding ``rank``'s random generator states."""
    return f"rng-rank{rank:05d}.pt"


def checkpoint_files(world: int, writers: list[int]) -> list[str]:
    """Every file of a checkpoint written by ``world`` ranks, with a shard file per rank in ``writers``."""
    return [STATE_FILE, *map(rng_file, range(world)), *map(shard_file, writers)]


def check_directory(directory: Path) -> None:
    """Refuse a directory that is a file, or a single checkpoint (one level too deep)."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint directory {directory} is a file, not a directory. Pass the folder that "
            "holds (or will hold) the step_* checkpoints."
        )
    if _NAME.match(directory.name) or (directory / STATE_FILE).exists():
        raise CheckpointError(
            f"{directory} is a single checkpoint, not a checkpoint directory: pass its parent "
            f"{directory.parent} (the folder that holds the step_* checkpoints)."
        )


def complete_dirs(directory: Path) -> list[Path]:
    """Published checkpoint directories, newest first (not yet verified)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def prune(directory: Path, newest: Path, keep: int, is_intact: Callable[[Path], bool]) -> None:
    """Keep ``newest`` and the next ``keep - 1`` intact checkpoints, newest step first.

    The checkpoint just written is never deleted, whatever its step (a fresh start after
    damaged checkpoints saves a lower step than theirs). Damaged checkpoints do not count as
    kept: they are moved aside with a warning naming them.
    """
    kept = 1
    higher: list[Path] = []  # kept checkpoints of a higher step than the one just written
    written = _NAME.match(newest.name)
    for path in complete_dirs(directory):
        if path == newest:
            continue
        if kept >= keep:
            shutil.rmtree(path, ignore_errors=True)
        elif is_intact(path):
            kept += 1
            found = _NAME.match(path.name)
            if written and found and int(found.group(1)) > int(written.group(1)):
                higher.append(path)
        else:
            _set_aside(directory, path)
    if higher:
        message = (
            f"checkpoint {newest.name} was just written, but {len(higher)} kept checkpoint(s) "
            f"have a higher step ({', '.join(p.name for p in higher)}): restore() and latest() "
            f"take the highest step, {higher[0].name}, not the newest written. When a run "
            "counts its steps again from a lower number, save into a new directory (or "
            "delete the higher steps)."
        )
        warnings.warn(message, stacklevel=4)
        logger.warning(message)


def _set_aside(directory: Path, path: Path) -> None:
    aside = directory / f"{_DAMAGED_PREFIX}{path.name}"
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
    # Attributed to Checkpointer.save (this function, prune, Checkpointer._publish, save).
    warnings.warn(message, stacklevel=4)
    logger.warning(message)
