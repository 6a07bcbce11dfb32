"""A copy of each rank's checkpoint files in shared memory, read back instead of the disk.

With ``Checkpointer(directory, memory=True)`` every rank also writes the bytes of its files
(the same checksummed bytes that go to disk) into a tmpfs directory, by default
``/dev/shm/lockstep-<hash of directory>/step_…/``: a worker's death does not free it (a
restarted worker on the same machine finds it), a machine's loss does. Ranks on one machine
share that directory, so on one machine it holds whole checkpoints; the next save sends each
rank's files to the next rank's machine too (``restoring.replicate_to_peer``: a ring).

``restore()`` reads the newest checkpoint on disk from memory when the copies of all its files
can be found there: each rank uses the files its machine holds and receives the others over the
process group from a rank that holds them (one on another machine); a file missing everywhere,
or one whose checksum fails, sends every rank back to the disk. The bytes are the disk's, so
what is restored is bitwise what the disk would give.

Each rank keeps its files of the last two steps it saved (a crash between two ranks' writes
still leaves one step complete) and removes the rest of its own; :meth:`MemoryCopies.clear`
(``Checkpointer.close()``) removes them all.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MemoryCopies", "default_memory_root", "remove_tree"]

_STEP = re.compile(r"^step_(\d{12})$")
_KEEP_STEPS = 2


def default_memory_root(directory: Path) -> Path:
    """``/dev/shm/lockstep-<12 hex digits of directory's absolute path>`` (the system's temp
    directory where there is no ``/dev/shm``)."""
    key = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"lockstep-{key}"


class MemoryCopies:
    """This rank's view of the shared-memory copies of one checkpoint directory.

    Args:
        root: the tmpfs directory holding ``step_…/`` folders of checkpoint files.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._mine: dict[int, list[str]] = {}  # step -> the files this object wrote
        self._started = False

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:012d}"

    def keep(self, step: int, name: str, payload: bytes | memoryview) -> None:
        """Write one of this rank's encoded files of ``step`` (atomic: temporary file, rename)."""
        if not self._started:
            self._started = True
            self._drop_stale(name)  # an earlier run's copies of this rank's files
        self._write(step, name, payload)
        self._mine.setdefault(step, []).append(name)
        for old in sorted(self._mine)[:-_KEEP_STEPS]:
            self._remove(old, self._mine.pop(old))

    def _drop_stale(self, name: str) -> None:
        for folder in self._folders():
            (folder / name).unlink(missing_ok=True)

    def _remove(self, step: int, names: list[str]) -> None:
        folder = self.step_dir(step)
        for name in names:
            (folder / name).unlink(missing_ok=True)
        _rmdir_if_empty(folder)

    def _folders(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if _STEP.match(p.name)]

    def held(self, step: int) -> list[str]:
        """The file names of ``step`` this machine holds (not yet verified)."""
        folder = self.step_dir(step)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))

    def read(self, step: int, name: str) -> bytes:
        return (self.step_dir(step) / name).read_bytes()

    def assemble(
        self,
        step: int,
        needed: list[str],
        held_by: list[list[str]],
        rank: int,
        broadcast: Callable[[Any, int], Any],
    ) -> Path | None:
        """Make ``step``'s folder here hold every file of ``needed``, receiving the files this
        machine lacks from a rank that holds them; ``None`` when some file is held nowhere.

        Args:
            held_by: each rank's :meth:`held` for ``step`` (gathered).
            broadcast: ``broadcast(value, src)`` over the process group, returning ``value``
                from ``src`` on every rank.
        """
        complete = True
        for name in needed:  # the same loop, the same broadcasts, on every rank
            holders = [r for r, names in enumerate(held_by) if name in names]
            if not holders:
                complete = False
                continue
            if len(holders) == len(held_by):
                continue  # every rank's machine has it
            source = holders[0]
            payload = broadcast(self._read_or_none(step, name) if rank == source else None,
                                source)
            if payload is None:
                complete = False
            elif rank not in holders:
                self.keep_received(step, name, payload)
        return self.step_dir(step) if complete else None

    def _read_or_none(self, step: int, name: str) -> bytes | None:
        try:
            return self.read(step, name)
        except OSError:
            return None

    def keep_received(self, step: int, name: str, payload: bytes) -> None:
        """Write a file of ``step`` received from another machine."""
        self._write(step, name, payload)
        self._mine.setdefault(step, []).append(name)
        for old in sorted(self._mine)[:-_KEEP_STEPS]:
            self._remove(old, self._mine.pop(old))

    def _write(self, step: int, name: str, payload: bytes | memoryview) -> None:
        folder = self.step_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(payload)
            os.replace(tmp, folder / name)
        except OSError:
            # A full tmpfs must not stay full of a partial copy (it is shared memory: the
            # DataLoader's workers need it too).
            tmp.unlink(missing_ok=True)
            if not self._mine.get(step):
                _rmdir_if_empty(folder)
            raise

    def clear(self) -> None:
        """Remove the copies of this rank's files (and the root once empty)."""
        for step, names in list(self._mine.items()):
            self._remove(step, names)
        self._mine.clear()
        _rmdir_if_empty(self.root)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty (another rank's files), or already gone


def remove_tree(root: Path) -> None:
    """Remove every copy under ``root`` (all ranks'): for tests and for rolling back by hand."""
    shutil.rmtree(root, ignore_errors=True)
