"""Restoring from the shared-memory copies (``Checkpointer(memory=True)``), the disk's fallback.

Every decision is taken from gathered values, so all ranks read from memory or all go to the
disk. Only the newest checkpoint published on disk is read from memory (never a newer step whose
disk copy was not published: a checkpoint still exists complete or not at all), so the result is
bitwise what reading the disk would give.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.directory import STATE_FILE, checkpoint_files, complete_dirs, rng_file
from lockstep.checkpoint.io import read_header, read_verified
from lockstep.checkpoint.loading import load_into
from lockstep.checkpoint.replicas import MemoryCopies
from lockstep.checkpoint.sharded import shard_file, shard_ranks

__all__ = [
    "broadcast_from",
    "memory_copy",
    "replicate_to_peer",
    "restore_from_memory",
    "ring_exchange",
]

logger = logging.getLogger(__name__)

Attempt = Callable[[Callable[[], Any]], tuple[Any, "str | None"]]


def memory_copy(memory: MemoryCopies, step: int, rank: int) -> Callable[[str, bytes | memoryview], None]:
    """The ``copy`` callback of ``write_files``: a failure (tmpfs full) only costs the copy."""

    def copy(name: str, data: bytes | memoryview) -> None:
        try:
            memory.keep(step, name, data)
        except OSError as exc:
            logger.warning("rank %d: could not keep %s of step %d in memory at %s (%s); "
                           "restoring it will read the disk", rank, name, step, memory.root, exc)

    return copy


def replicate_to_peer(
    memory: MemoryCopies,
    step: int,
    rank: int,
    world: int,
    gather: Callable[[Any], list[Any]],
    exchange: Callable[[Any, int, int], Any],
) -> None:
    """Copy this rank's files of ``step`` into the memory of rank ``rank + 1``'s machine (a
    ring: rank r holds rank r-1's), so a lost machine's files survive on the next one.

    Skipped where the next rank's machine already holds them (ranks on one machine share its
    tmpfs). ``exchange(value, dst, src)`` sends ``value`` to ``dst`` and returns what ``src``
    sent; every rank calls this at the same point (inside ``save()``/``wait()``).
    """
    held = memory.held(step)
    own = {STATE_FILE} if rank == 0 else set()
    own |= {rng_file(rank), shard_file(rank)}
    holdings = gather(held)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    send = {}
    if not own.issubset(holdings[nxt]):
        send = {name: memory.read(step, name) for name in held if name in own}
    got = exchange(send or None, nxt, prev)
    for name, payload in (got or {}).items():
        memory.keep_received(step, name, payload)


def restore_from_memory(
    memory: MemoryCopies,
    directory: Path,
    rank: int,
    objects: Mapping[str, Any],
    gather: Callable[[Any], list[Any]],
    broadcast: Callable[[Any, int], Any],
    attempt: Attempt,
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest published checkpoint from memory: ``(its disk path, its state.pt)``, or
    ``None`` (on every rank) when some file is missing or damaged everywhere: read the disk."""
    newest = complete_dirs(directory)[:1] if rank == 0 else []
    name = gather(newest[0].name if newest else None)[0]
    if name is None:
        return None
    step = int(name.split("_")[1])
    held_by = gather(memory.held(step))
    if not any(STATE_FILE in names for names in held_by):
        return None
    folder = memory.assemble(step, [STATE_FILE], held_by, rank, broadcast)
    state, error = attempt(lambda: read_verified(memory.step_dir(step) / STATE_FILE))
    if folder is None or _anyone(gather(error)):
        return None
    meta = state["meta"]
    needed = checkpoint_files(meta["world_size"], shard_ranks(meta))
    folder = memory.assemble(step, needed, gather(memory.held(step)), rank, broadcast)
    if _anyone(gather(None if folder is not None else "missing")):
        return None
    _, error = attempt(lambda: [read_verified(memory.step_dir(step) / n) for n in needed[1:]])
    if _anyone(gather(error)):
        return None
    # The copies must be of this checkpoint, not of an older run's with the same step (its
    # directory deleted by hand, say): every file's header (CRC-32, length) is the disk's.
    disk = gather([read_header(directory / name / n) for n in needed] if rank == 0 else None)[0]
    mine = [read_header(memory.step_dir(step) / n) for n in needed]
    if _anyone(gather(None if mine == disk else "stale")):
        if rank == 0:
            logger.warning("the copies of %s in memory at %s are not those on disk (another "
                           "run's?); reading the disk", name, memory.root)
        return None
    _, error = attempt(lambda: load_into(memory.step_dir(step), state, rank, objects))
    if _anyone(gather(error)):
        logger.warning("rank %d: loading %s from memory failed (%s); reading the disk", rank,
                       name, error)
        return None
    if rank == 0:
        logger.info("resumed from checkpoint %s, read from memory at %s", directory / name,
                    memory.root)
    return directory / name, state


def _anyone(errors: list[Any]) -> bool:
    return any(e is not None for e in errors)


def broadcast_from(value: Any, src: int, *, world: int, group: Any = None) -> Any:
    """``value`` of group rank ``src``, on every rank of ``group``."""
    if world == 1:
        return value
    if group is not None:
        src = dist.get_global_rank(group, src)
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def ring_exchange(value: Any, dst: int, src: int, *, rank: int, group: Any = None) -> Any:
    """Send ``value`` to group rank ``dst`` and return what ``src`` sent. Even ranks send first,
    odd ranks receive first, so a ring of blocking sends cannot wait on itself."""
    to = dst if group is None else dist.get_global_rank(group, dst)
    frm = src if group is None else dist.get_global_rank(group, src)
    box: list[Any] = [None]
    if rank % 2 == 0:
        dist.send_object_list([value], dst=to, group=group)
        dist.recv_object_list(box, src=frm, group=group)
    else:
        dist.recv_object_list(box, src=frm, group=group)
        dist.send_object_list([value], dst=to, group=group)
    return box[0]
