"""How a save reaches the disk: a staging directory, checksummed files, one rename to publish.

Every file is written into ``.staging-step_…`` (temporary file, fsync, rename: see ``io.py``),
each with a CRC-32 that restoring checks. Once every rank has written its files, rank 0 renames
the staging directory to its final name, so a checkpoint exists complete or not at all.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint.directory import FORMAT, STATE_FILE, check_directory, rng_file
from lockstep.checkpoint.io import check_loadable, encode, fsync_dir, save_atomic, write_atomic
from lockstep.checkpoint.sharded import shard_file
from lockstep.checkpoint.state import capture_rng, object_state

__all__ = [
    "collect_rank_files",
    "prepare_staging",
    "publish",
    "staging_dir",
    "write_files",
    "write_rank_files",
]

_STAGING_PREFIX = ".staging-"
_REPLACED_PREFIX = ".replaced-"


def staging_dir(final: Path) -> Path:
    """Where the checkpoint that will be ``final`` is written until it is complete."""
    return final.parent / f"{_STAGING_PREFIX}{final.name}"


def prepare_staging(directory: Path, staging: Path) -> None:
    """Create ``staging`` in ``directory``, clearing what earlier saves cut short left behind."""
    check_directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{_STAGING_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)  # saves cut short by a crash
    for replaced in directory.glob(f"{_REPLACED_PREFIX}*"):
        # A crash between moving a re-saved step aside and publishing its new copy: put
        # the old copy back when no new one made it, otherwise it is garbage.
        final = directory / replaced.name[len(_REPLACED_PREFIX):]
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(replaced, final)
    staging.mkdir()


def collect_rank_files(
    rank: int,
    world: int,
    step: int,
    epoch: int,
    extra: Mapping[str, Any] | None,
    objects: Mapping[str, Any],
    sharded: list[str],
    writers: list[int],
) -> dict[str, Any]:
    """This rank's files, by name, as the objects to encode: ``state.pt`` (rank 0), its shard
    file, its RNG states. The values still reference the live tensors (see ``snapshot.py``).

    Args:
        rank: this rank; world: the number of ranks saving.
        step: the step to resume at; epoch: the current epoch.
        extra: the user's plain values (``None``: none).
        objects: name -> object, as passed to ``save``.
        sharded: the names of the objects written one piece per rank.
        writers: the ranks that write a shard file (``lockstep.checkpoint.sharded.shard_writers``).

    Raises:
        TypeError: something weights-only loading would refuse, named by its path.
    """
    files: dict[str, Any] = {}
    if rank == 0:
        meta = {"format": FORMAT, "step": step, "epoch": int(epoch), "world_size": world,
                "sharded": sharded, "shard_ranks": writers}
        whole = {n: o for n, o in objects.items() if n not in sharded}
        payload: dict[str, Any] = {"meta": meta, "extra": dict(extra or {}), "objects": {}}
        for name, obj in whole.items():
            payload["objects"][name] = object_state(name, obj)
        check_loadable(payload["extra"], "extra")
        for name, state in payload["objects"].items():
            check_loadable(state, f"{name}.state_dict()")
        files[STATE_FILE] = payload
    if rank in writers:
        pieces = {name: objects[name].sharded_state_dict() for name in sharded}
        check_loadable(pieces, f"rank {rank}'s sharded_state_dict()")
        files[shard_file(rank)] = pieces
    files[rng_file(rank)] = capture_rng()
    return files


def write_files(
    staging: Path, files: Mapping[str, Any], copy: Callable[[str, bytes | memoryview], None] | None = None,
    split: Collection[int] = (),
) -> None:
    """Encode (checksummed) and write each of ``files`` into ``staging`` atomically; ``copy``,
    if given, receives each file's name and bytes first (the shared-memory copy). Without
    ``copy`` each file is streamed to the disk as it is encoded (no copy of it in memory).
    ``split``: the snapshot's blocks (``Snapshot.blocks``), whose tensors are written each as
    a storage of its own."""
    for name, content in files.items():
        if copy is None:
            save_atomic(staging / name, content, split)
            continue
        data = encode(content, split)
        copy(name, data)
        write_atomic(staging / name, data)


def write_rank_files(
    staging: Path,
    rank: int,
    world: int,
    step: int,
    epoch: int,
    extra: Mapping[str, Any] | None,
    objects: Mapping[str, Any],
    sharded: list[str],
    writers: list[int],
) -> None:
    """Write this rank's files into ``staging`` now (see :func:`collect_rank_files`)."""
    write_files(
        staging, collect_rank_files(rank, world, step, epoch, extra, objects, sharded, writers)
    )


def publish(directory: Path, staging: Path, final: Path) -> None:
    """Rename the complete ``staging`` to ``final`` (an earlier copy of that step is replaced)."""
    fsync_dir(staging)
    if final.exists():
        # Re-saving a step (its earlier copy was damaged): move it aside, never overwrite.
        trash = directory / f"{_REPLACED_PREFIX}{final.name}"
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_dir(directory)
