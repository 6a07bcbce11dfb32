"""Objects that save one piece per rank (a fully sharded model, its optimizer): protocol and files.

An object given to :meth:`Checkpointer.save` is saved *sharded* when it has
``sharded_state_dict()`` and ``load_sharded_state_dict(pieces)`` and its ``save_sharded``
attribute (if any) is true. Then every rank writes its own piece, no rank gathers anything:
each rank's pieces of all such objects go into one file of that rank, ``shard-rank00003.pt``
(``{name: piece}``), and ``state.pt`` lists their names. Restoring calls
``load_sharded_state_dict`` with a :class:`SavedPieces`: the world size that saved and each
rank's piece, read from its file (checksum verified) only when asked for, so that a restore at
another world size reads only the files it needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep.checkpoint.io import CheckpointError, read_verified

__all__ = ["SavedPieces", "ShardFiles", "saves_sharded", "shard_file"]


def saves_sharded(obj: Any) -> bool:
    """Whether :meth:`Checkpointer.save` writes ``obj`` as one piece per rank."""
    return (
        callable(getattr(obj, "sharded_state_dict", None))
        and callable(getattr(obj, "load_sharded_state_dict", None))
        and bool(getattr(obj, "save_sharded", True))
    )


def shard_file(rank: int) -> str:
    """The file holding rank ``rank``'s pieces of the sharded objects."""
    return f"shard-rank{rank:05d}.pt"


class ShardFiles:
    """The shard files of one checkpoint, each read and verified at most once."""

    def __init__(self, path: Path, world_size: int) -> None:
        self.path, self.world_size = path, world_size
        self._read: dict[int, dict[str, Any]] = {}

    def pieces(self, rank: int) -> dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.path} was written by {self.world_size} ranks; there is no rank {rank}")
        if rank not in self._read:
            self._read[rank] = read_verified(self.path / shard_file(rank))
        return self._read[rank]


class SavedPieces:
    """What one sharded object saved: ``pieces[r]`` is rank ``r``'s piece, ``len(pieces)`` the world."""

    def __init__(self, files: ShardFiles, name: str) -> None:
        self.files, self.name = files, name

    def __len__(self) -> int:
        return self.files.world_size

    def __getitem__(self, rank: int) -> Any:
        pieces = self.files.pieces(rank)
        if self.name not in pieces:
            raise CheckpointError(
                f"{self.files.path / shard_file(rank)} has no piece of {self.name!r}; it holds "
                f"{sorted(pieces)}"
            )
        return pieces[self.name]

    @property
    def source(self) -> str:
        """The files, for error messages."""
        return str(self.files.path / "shard-rank*.pt")
