"""How checkpoint bytes reach the disk and come back: atomically, checksummed, never unpickled.

A checkpoint file is a one-line header (format tag, CRC-32 and length of the payload) followed
by the payload: the lean encoding of ``tensorfile.py`` (tag ``LOCKSTEP-CKPT-2``) where the state
is plain containers, scalars and dense CPU tensors, as a snapshot's always is, else ``torch.save``
output (``LOCKSTEP-CKPT-1``). Reading checks the length before anything is deserialised and the
checksum before anything is returned, so a truncated or corrupted file is reported as such;
deserialising resolves no global but ``OrderedDict`` (lean) or uses
``torch.load(weights_only=True)``, which accepts tensors and plain containers only, so a file
from elsewhere cannot run code. What we write is limited to those same types, checked up front.
"""

from __future__ import annotations

import errno
import io
import os
import socket
import zlib
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any, cast

import torch

from lockstep.checkpoint import tensorfile

__all__ = [
    "SCALARS",
    "CheckpointError",
    "check_length",
    "check_loadable",
    "decode",
    "encode",
    "fsync_dir",
    "load_file",
    "read_header",
    "read_verified",
    "save_atomic",
    "write_atomic",
]

_MAGIC = b"LOCKSTEP-CKPT-1"  # the payload is torch.save output
_LEAN_MAGIC = b"LOCKSTEP-CKPT-2"  # the payload is tensorfile's encoding
_MAGICS = (_MAGIC, _LEAN_MAGIC)
# Types that torch.load(weights_only=True) restores on every torch we support (>= 2.4); immutable.
SCALARS = frozenset({type(None), bool, int, float, str})
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or applied; the message names the file."""


def check_loadable(obj: Any, where: str) -> None:
    """Raise ``TypeError`` if ``obj`` holds anything weights-only loading would refuse.

    Raises:
        TypeError: naming the path inside ``obj`` (e.g. ``extra['cfg'][2]``) and its type.
    """
    if isinstance(obj, torch.Tensor) or type(obj) in SCALARS:
        return
    # Scalars and tensors inside a container are passed over here, without a call or the path
    # of each: a state has hundreds, and a save every step checks them all (issue #24).
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int")
            if type(value) not in SCALARS and type(value) is not torch.Tensor:
                check_loadable(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            if type(value) not in SCALARS and type(value) is not torch.Tensor:
                check_loadable(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which lockstep will not "
        "pickle: checkpoints hold only tensors, numbers, strings, None, lists, tuples and dicts "
        "so that loading one can never run code. Convert it (e.g. a dataclass to a dict)."
    )


def _checksum(payload: bytes | memoryview) -> bytes:
    # CRC-32 finds truncation and bit rot at memory speed; safety against a crafted file does not
    # rest on it but on weights-only loading, so a cryptographic hash would only cost time.
    return b"%08x" % zlib.crc32(payload)


def _header(digest: bytes, length: int, magic: bytes = _MAGIC) -> bytes:
    # Fixed width (the length zero-padded), so that it can be written before the payload is
    # known and filled in after: the bytes are never copied to put a header in front of them.
    return b"%s %s %020d\n" % (magic, digest, length)


_HEADER_SIZE = len(_header(b"0" * 8, 0))


def encode(obj: Any, split: Collection[int] = ()) -> memoryview:
    """Serialise ``obj`` and prefix it with the header that lets :func:`decode` verify it.

    The result is a view of the one buffer the payload was encoded into (no copy of it).
    ``split``: as :func:`tensorfile.plan`'s (the snapshot's blocks).
    """
    buffer = io.BytesIO()
    buffer.write(bytes(_HEADER_SIZE))
    lean = tensorfile.plan(obj, split)
    if lean is not None:
        for piece in lean.pieces():
            buffer.write(piece)
    else:
        torch.save(obj, buffer)
    data = buffer.getbuffer()
    payload = data[_HEADER_SIZE:]
    magic = _MAGIC if lean is None else _LEAN_MAGIC
    data[:_HEADER_SIZE] = _header(_checksum(payload), len(payload), magic)
    return data


def decode(data: bytes | memoryview, path: Path | str) -> Any:
    """Verify ``data`` (as read from ``path``) and deserialise it without running any code.

    Raises:
        CheckpointError: the file is truncated, corrupted, not a lockstep checkpoint, or holds
            objects other than tensors and plain containers.
    """
    header, newline, payload = bytes(data).partition(b"\n")
    return _verified_load(header + newline, payload, path)


def _verified_load(header: bytes, payload: bytes, path: Path | str) -> Any:
    """Check ``payload`` against its ``header`` line (as written by :func:`encode`), then load it."""
    magic, digest = _check_header(header, len(payload), path)
    source = io.BytesIO(payload)  # shares the bytes, does not copy them
    if magic == _LEAN_MAGIC:
        return _lean_load(source.readinto, len(payload), lambda: _checksum(payload), digest, path)
    if _checksum(payload) != digest:
        raise CheckpointError(_corrupted(path))
    return _safe_load(source, path)


def _corrupted(path: Path | str) -> str:
    return f"{path} is corrupted: its CRC-32 checksum does not match its header"


def _lean_load(readinto: Any, length: int, checksum: Any, digest: bytes, path: Path | str) -> Any:
    """Rebuild a lean payload in one pass, checksumming it on the way (see ``tensorfile.read``)."""
    try:
        obj, crc = tensorfile.read(readinto, length)
    except ValueError as exc:
        if checksum() != digest:  # damage, not a crafted file: say so
            raise CheckpointError(_corrupted(path)) from exc
        raise CheckpointError(f"refusing to load {path}: {exc}") from exc
    if b"%08x" % crc != digest:
        raise CheckpointError(_corrupted(path))
    return obj


def _check_header(header: bytes, length: int, path: Path | str) -> tuple[bytes, bytes]:
    """The format tag and checksum ``header`` gives, once it is a lockstep header and
    ``length`` its length."""
    parts = header.rstrip(b"\n").split(b" ")
    if not header.endswith(b"\n") or len(parts) != 3 or parts[0] not in _MAGICS:
        raise CheckpointError(f"{path} is not a lockstep checkpoint file (bad header)")
    expected = int(parts[2]) if parts[2].isdigit() else -1
    if length != expected:
        raise CheckpointError(
            f"{path} is truncated: {length} of {expected} bytes; the write was cut short"
        )
    return parts[0], parts[1]


class _Section(io.RawIOBase):
    """``length`` bytes of an open file from ``start`` on, as a file of their own: what
    ``torch.load`` reads the payload through, straight into the tensors' memory."""

    def __init__(self, fh: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._pos)
        if count <= 0:
            return 0
        self._fh.seek(self._start + self._pos)
        got = self._fh.readinto(view[:count]) or 0
        self._pos += got
        return got

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def checksum(self, chunk: int = 1024 * 1024) -> bytes:
        """The CRC-32 of the section, read in pieces of ``chunk`` bytes (never whole)."""
        crc, buffer = 0, bytearray(min(chunk, max(self._length, 1)))
        self.seek(0)
        while got := self.readinto(buffer):
            crc = zlib.crc32(memoryview(buffer)[:got], crc)
        self.seek(0)
        return b"%08x" % crc


def _safe_load(source: Any, path: Path | str) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"refusing to load {path}: it holds objects other than tensors and plain containers, "
            f"and unpickling them could run code ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc


def _write_fully(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable (a no-op where directories can't sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent or complete.

    The bytes go to ``path.tmp``, are fsync'ed, then renamed over ``path``.

    Raises:
        CheckpointError: the write failed; a full disk or quota is named as such.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_fully(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(describe_os_error(exc, path, len(data))) from exc


class _Streamed:
    """The file ``torch.save`` writes into: each piece goes to ``fd`` and into a running CRC-32,
    so the payload is never held in memory as a whole. The zip format's many small pieces
    (headers, names, small tensors) are gathered into writes of about a MiB; large pieces go
    straight from the tensor's memory."""

    _SMALL = 64 * 1024
    _GATHER = 1024 * 1024

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.length = 0
        self.error: OSError | None = None
        self._pending = bytearray()

    def write(self, piece: bytes | memoryview) -> int:
        self.crc = zlib.crc32(piece, self.crc)
        self.length += len(piece)
        if len(piece) < self._SMALL:
            self._pending += piece
            if len(self._pending) >= self._GATHER:
                self.flush()
        else:
            self.flush()
            self._write(piece)
        return len(piece)

    def flush(self) -> None:
        """Write what was gathered."""
        if self._pending:
            self._write(self._pending)
            self._pending = bytearray()

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            _write_fully(self.fd, data)
        except OSError as exc:
            self.error = exc  # torch.save may wrap it: kept to be named
            raise


def save_atomic(path: Path, obj: Any, split: Collection[int] = ()) -> None:
    """Encode ``obj`` as :func:`encode` does, straight into ``path`` (either absent or complete).

    ``torch.save`` streams into ``path.tmp`` behind a header of fixed width, which is filled in
    once the length and checksum are known; then fsync and rename. Unlike ``write_atomic(path,
    encode(obj))`` no copy of the whole payload is made in memory.

    Raises:
        CheckpointError: the write failed; a full disk or quota is named as such.
    """
    tmp = path.with_name(path.name + ".tmp")
    sink: _Streamed | None = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_fully(fd, bytes(_HEADER_SIZE))
            sink = _Streamed(fd)
            lean = tensorfile.plan(obj, split)
            if lean is not None:
                for piece in lean.pieces():
                    sink.write(piece)
            else:
                torch.save(obj, cast(IO[bytes], sink))  # write() is all torch.save uses
            sink.flush()
            magic = _MAGIC if lean is None else _LEAN_MAGIC
            os.pwrite(fd, _header(b"%08x" % sink.crc, sink.length, magic), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        error = sink.error if sink is not None and sink.error is not None else exc
        if not isinstance(error, OSError):
            raise
        size = sink.length if sink is not None else None
        raise CheckpointError(describe_os_error(error, path, size)) from error


def _size(nbytes: int) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes} bytes"


def describe_os_error(exc: OSError, path: Path, size: int | None = None) -> str:
    """A message for a failed checkpoint write that says what to do about it."""
    if exc.errno in _DISK_FULL:
        need = f" ({_size(size)} needed)" if size is not None else ""
        return (
            f"cannot write {path}: the disk or quota is full{need} ({exc.strerror}). Free space "
            "or lower `keep`; the previous checkpoint is untouched."
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"cannot write {path}: {exc.strerror}. Choose a checkpoint directory this user can "
            "write to; the previous checkpoint is untouched."
        )
    return f"cannot write {path}: {exc}{unseen_directory(exc, path)}; the previous checkpoint is untouched."


def unseen_directory(exc: OSError, path: Path) -> str:
    """A hint for a file whose directory is missing on this machine: another rank made that
    directory, so the checkpoint directory is probably not shared by every machine."""
    if exc.errno != errno.ENOENT or path.parent.exists():
        return ""
    return (
        f". Its directory {path.parent.name} is missing on this machine ({socket.gethostname()}),"
        " though another rank made it: the checkpoint directory is probably not shared by every"
        " machine. Give every rank a directory on a filesystem they all see (the same path on"
        " each machine)"
    )


def cannot_read(exc: OSError, path: Path) -> CheckpointError:
    """The error for a checkpoint file that could not be read."""
    return CheckpointError(f"cannot read {path}: {exc}{unseen_directory(exc, path)}")


def check_length(path: Path) -> None:
    """Check, from its header alone, that ``path`` is present and complete (no checksum).

    Raises:
        CheckpointError: the file is missing, not a lockstep checkpoint file, or truncated.
    """
    try:
        with path.open("rb") as fh:
            header = fh.readline(len(_MAGIC) + 64)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise cannot_read(exc, path) from exc
    parts = header.rstrip(b"\n").split(b" ")
    if len(parts) != 3 or parts[0] not in _MAGICS or not parts[2].isdigit():
        raise CheckpointError(f"{path} is not a lockstep checkpoint file (bad header)")
    if size - len(header) != int(parts[2]):
        raise CheckpointError(
            f"{path} is truncated: {size - len(header)} of {int(parts[2])} bytes"
        )


def read_header(path: Path) -> bytes | None:
    """The first line of a checkpoint file (format, CRC-32 and length): two files with the same
    header hold the same bytes. ``None`` when the file cannot be read."""
    try:
        with path.open("rb") as fh:
            return fh.readline(_HEADER_SIZE + 64)
    except OSError:
        return None


def read_verified(path: Path) -> Any:
    """Read, verify and deserialise one file written by :func:`write_atomic` of :func:`encode`."""
    # The payload is never held whole in memory beside the tensors: a lean one is read once,
    # straight into them, checksummed on the way; torch.save output twice from the page cache,
    # in pieces (its checksum), then by torch.load.
    try:
        with path.open("rb") as fh:
            header = fh.readline(_HEADER_SIZE + 64)
            start = fh.tell()
            length = os.fstat(fh.fileno()).st_size - start
            magic, digest = _check_header(header, length, path)
            payload = _Section(fh, start, length)
            if magic == _LEAN_MAGIC:
                return _lean_load(payload.readinto, length, payload.checksum, digest, path)
            if payload.checksum() != digest:
                raise CheckpointError(_corrupted(path))
            return _safe_load(payload, path)
    except OSError as exc:
        raise cannot_read(exc, path) from exc


def load_file(path: Path | str) -> Any:
    """Load a lockstep checkpoint file, a ``torch.save`` file or a ``.safetensors`` file safely.

    Nothing is unpickled beyond tensors and plain containers, whoever wrote the file.

    Raises:
        CheckpointError: the file is missing, damaged, or holds arbitrary objects.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file as load_safetensors
        except ImportError as exc:
            raise CheckpointError(f"reading {path} needs `pip install safetensors`") from exc
        try:
            return load_safetensors(str(path), device="cpu")
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        with path.open("rb") as f:
            if f.read(len(_MAGIC)) not in _MAGICS:
                f.seek(0)
                return _safe_load(f, path)
    except OSError as exc:
        raise cannot_read(exc, path) from exc
    return read_verified(path)
