"""Objects that save one piece per rank (a fully sharded model, its optimizer): protocol and files.

An object given to :meth:`Checkpointer.save` is saved *sharded* when it has
``sharded_state_dict()`` and ``load_sharded_state_dict(pieces)`` and its ``save_sharded``
attribute (if any) is true. Then each rank writes its own piece, no rank gathers anything:
each rank's pieces of all such objects go into one file of that rank, ``shard-rank00003.pt``
(``{name: piece}``), and ``state.pt`` lists their names and the ranks that wrote a file.

A rank whose pieces only repeat another rank's (a replica under hybrid sharding) says so with
``writes_piece()`` returning false: it writes no shard file, and the ranks agree on who writes
before anything is written (:func:`writes_shard`, gathered in a collective), so no rank waits
on another.

Restoring calls ``load_sharded_state_dict`` with a :class:`SavedPieces`: the world size that
saved and each writing rank's piece, read from its file (checksum verified) only when asked
for, so that a restore at another world size reads only the files it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lockstep.checkpoint.io import CheckpointError, read_verified

__all__ = ["SavedPieces", "ShardFiles", "saves_sharded", "shard_file", "shard_ranks", "shard_writers",
           "writes_piece", "writes_shard"]


def saves_sharded(obj: Any) -> bool:
    """Whether :meth:`Checkpointer.save` writes ``obj`` as one piece per rank."""
    return (
        callable(getattr(obj, "sharded_state_dict", None))
        and callable(getattr(obj, "load_sharded_state_dict", None))
        and bool(getattr(obj, "save_sharded", True))
    )


def writes_piece(obj: Any) -> bool:
    """Whether this rank's piece of ``obj`` is needed (``False`` on replicas; default ``True``)."""
    method = getattr(obj, "writes_piece", None)
    return bool(method()) if callable(method) else True


def writes_shard(objects: Iterable[Any]) -> bool:
    """Whether this rank writes a shard file: it holds a needed piece of one of ``objects``."""
    return any(writes_piece(obj) for obj in objects)


def shard_writers(flags: list[bool]) -> list[int]:
    """The ranks that write a shard file, from every rank's :func:`writes_shard` in rank order
    (gathered by a collective every rank takes part in, so a rank writing nothing does too)."""
    return [rank for rank, flag in enumerate(flags) if flag]


def shard_ranks(meta: Mapping[str, Any]) -> list[int]:
    """The ranks whose shard files a checkpoint holds, from its ``state.pt`` metadata.

    Checkpoints written before replicas could skip their files record no list: every rank wrote.
    """
    if not meta.get("sharded"):
        return []
    world = meta.get("world_size")
    ranks = meta.get("shard_ranks")
    if ranks is None:
        return list(range(world)) if isinstance(world, int) else []
    if not isinstance(ranks, list) or not all(isinstance(r, int) and 0 <= r < (world or 0) for r in ranks):
        raise CheckpointError(f"state.pt records invalid shard_ranks {ranks!r} for a world of {world!r}")
    return ranks


def shard_file(rank: int) -> str:
    """The file holding rank ``rank``'s pieces of the sharded objects."""
    return f"shard-rank{rank:05d}.pt"


class ShardFiles:
    """The shard files of one checkpoint, each read and verified at most once.

    Args:
        path: the checkpoint directory.
        world_size: the world that saved it.
        ranks: the ranks that wrote a shard file (``None``: all of them).
    """

    def __init__(self, path: Path, world_size: int, ranks: Sequence[int] | None = None) -> None:
        self.path, self.world_size = path, world_size
        self.ranks = frozenset(range(world_size) if ranks is None else ranks)
        self._read: dict[int, dict[str, Any]] = {}

    def pieces(self, rank: int) -> dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.path} was written by {self.world_size} ranks; there is no rank {rank}")
        if rank not in self.ranks:
            raise CheckpointError(
                f"{self.path}: rank {rank} wrote no shard file (its pieces repeated another rank's); "
                f"the files are those of ranks {sorted(self.ranks)}. A sharded object must read the "
                "pieces of the ranks that wrote them."
            )
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
