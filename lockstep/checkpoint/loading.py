"""Reading a checkpoint back: which ones are intact, and loading one into the caller's objects.

A checkpoint is intact when every file it should hold is there and passes its CRC-32. Each is
read in full at most once per process; one already written or verified gets a cheap check
(every file present, none truncated) when pruning looks at it again.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint.directory import (
    FORMAT,
    STATE_FILE,
    checkpoint_files,
    complete_dirs,
    rng_file,
)
from lockstep.checkpoint.io import CheckpointError, check_length, read_verified
from lockstep.checkpoint.sharded import SavedPieces, ShardFiles, shard_ranks
from lockstep.checkpoint.state import apply_state, restore_rng

__all__ = ["IntactCheckpoints", "load_into"]

logger = logging.getLogger(__name__)


class IntactCheckpoints:
    """The checkpoints this process wrote or verified, with their files."""

    def __init__(self) -> None:
        self._known: dict[Path, list[str]] = {}

    def remember(self, path: Path, files: list[str]) -> None:
        """``path`` was just written, complete, with ``files``."""
        self._known[path] = files

    def verify(self, path: Path) -> dict[str, Any]:
        """Read every file of ``path`` in full (checksums); returns its ``state.pt``.

        Raises:
            CheckpointError: naming the file that is missing, truncated, corrupt or foreign.
        """
        state = read_verified(path / STATE_FILE)
        meta = state.get("meta", {}) if isinstance(state, dict) else {}
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path / STATE_FILE} has unknown format {meta.get('format')!r}")
        world = meta.get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{path / STATE_FILE} records no valid world_size ({world!r})")
        files = checkpoint_files(world, shard_ranks(meta))
        for name in files[1:]:
            read_verified(path / name)
        self._known[path] = files
        return state

    def is_intact(self, path: Path) -> bool:
        """Whether ``path`` reads back intact (in full once, then a cheap check)."""
        try:
            files = self._known.get(path)
            if files is None:
                self.verify(path)
            else:
                for name in files:
                    check_length(path / name)
        except CheckpointError:
            self._known.pop(path, None)
            return False
        return True

    def newest(self, directory: Path) -> tuple[Path, dict[str, Any]] | None:
        """The newest intact checkpoint in ``directory`` and its state; damaged ones are skipped
        with a warning (attributed to the caller's caller)."""
        for path in complete_dirs(directory):
            try:
                return path, self.verify(path)
            except CheckpointError as exc:
                warnings.warn(f"skipping damaged checkpoint {path}: {exc}", stacklevel=3)
                logger.warning("skipping damaged checkpoint %s: %s", path, exc)
        return None


def load_into(
    path: Path, state: dict | None, rank: int, objects: Mapping[str, Any]
) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``objects`` and this rank's random generators.

    Args:
        path: the checkpoint directory.
        state: its ``state.pt`` if already read (rank 0 verified it), else ``None``.
        rank: this rank (a rank the checkpoint has no RNG file for starts its generators fresh).
        objects: name -> object, as passed to ``restore``.

    Returns:
        The checkpoint's ``state.pt`` (its ``meta`` and ``extra``).

    Raises:
        CheckpointError: a name is missing, or an object cannot load what was saved for it.
    """
    state = state if state is not None else read_verified(path / STATE_FILE)
    saved, meta = state["objects"], state["meta"]
    sharded = set(meta.get("sharded", ()))
    absent = sorted(set(objects) - set(saved) - sharded)
    if absent:
        raise CheckpointError(
            f"{path} has no {', '.join(map(repr, absent))}; it holds {sorted({*saved, *sharded})}. "
            "Pass the names used when saving."
        )
    files = ShardFiles(path, meta["world_size"], shard_ranks(meta))
    # Objects saved whole first, then those saved one piece per rank, which may hold what is
    # per rank in a whole object too (LocalSGD's own replica of the model saved from rank 0).
    ordered = sorted(objects.items(), key=lambda item: item[0] in sharded)
    for name, obj in ordered:
        if name not in sharded:
            apply_state(name, obj, saved[name], str(path / STATE_FILE))
        elif callable(getattr(obj, "load_sharded_state_dict", None)):
            obj.load_sharded_state_dict(SavedPieces(files, name))
        else:
            raise CheckpointError(
                f"{path} holds {name!r} sharded (one piece per rank); a "
                f"{type(obj).__name__} cannot load that. Pass lockstep.fsdp.ModelState(model) "
                "or OptimizerState(model, optimizer), which load it into a sharded or plain model."
            )
    if rank < meta["world_size"]:
        restore_rng(read_verified(path / rng_file(rank)))
    else:
        logger.warning(
            "rank %d: %s was written by %d ranks, so this rank's random generators start "
            "fresh", rank, path, meta["world_size"],
        )
    return state
