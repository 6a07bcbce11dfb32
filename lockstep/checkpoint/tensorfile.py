"""A lean encoding of a checkpoint's state: the structure pickled once, then the tensors' bytes.

``torch.save`` runs Python hooks for every object it pickles and writes each tensor as an entry
of a zip archive; for a state of a few hundred tensors that is most of a save's CPU time (22 of
the 39 ms a 9.5 MiB GPT + AdamW state took on the writing thread). Here the structure (dicts,
lists, tuples, numbers, strings, bytes, sets; an ``OrderedDict`` with its attributes, as
``state_dict()`` returns) goes through the C pickler with each tensor replaced by a description of it, and each
storage's bytes follow, 64-byte aligned, written straight from the tensor's memory::

    <u64 length of the pickle> <pickle> <pad> <storage 0> <pad> <storage 1> <pad> ...

Loading never runs code: the unpickler resolves two names, ``collections.OrderedDict`` and the
tensor marker (``_tensor``, mapped to the reader's own builder), and the reader rebuilds each
tensor from its description after checking it against the file.

A state holding anything else (a tensor subclass such as ``nn.Parameter``, a tensor not in CPU
memory, sparse or quantized, another type) has no such encoding: :func:`plan` returns ``None``
and the caller falls back to ``torch.save``.
"""

from __future__ import annotations

import collections
import ctypes
import io
import pickle
import struct
import sys
import zlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

__all__ = ["Plan", "plan", "read"]

_ALIGN = 64
_LENGTH = struct.Struct("<Q")
# Exact instances of these pickle natively (most never reach reducer_override).
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, set, frozenset, dict,
                    collections.OrderedDict, list, tuple})
_TAG = "lockstep-tensor"
# What one storage of the file is: (storage, first byte, bytes): all of a tensor's storage, or
# the part of a block that one of the snapshot's buffers holds (see ``plan``'s ``split``).
Segment = tuple[torch.UntypedStorage, int, int]


def _memory(storage: torch.UntypedStorage) -> memoryview:
    """A byte view of a CPU storage's memory (no copy); the storage must outlive it."""
    size = storage.nbytes()
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * size).from_address(storage.data_ptr())).cast("B")


def _padding(offset: int) -> int:
    return -offset % _ALIGN


class _NotPlain(Exception):
    pass


def _tensor(description: Any) -> torch.Tensor:
    """What a tensor pickles as: a call of this function with the tensor's description. The
    reader maps the name to its own builder (:meth:`_Tensors.build`); this is never called."""
    raise RuntimeError("tensorfile._tensor is a marker in the pickle; read files with tensorfile.read")


class _Pickler(pickle.Pickler):
    """Pickles the structure; each tensor becomes a call of :func:`_tensor` describing it.

    ``reducer_override`` is not called for exact ``dict``, ``list``, ``tuple``, ``str``,
    ``int``, ``float``, ``bool`` or ``None`` (the C pickler handles them itself), so the Python
    code below runs once per tensor and ``OrderedDict``, not once per object as a
    ``persistent_id`` would: a few thousand calls fewer per save of a model and its optimizer,
    on a thread that shares the GIL with training (issue #24). Files written with persistent
    ids by earlier versions still load (:class:`_Unpickler`).
    """

    def __init__(self, file: io.BytesIO, split: Collection[int] = ()) -> None:
        super().__init__(file, protocol=4)
        self.storages: list[Segment] = []
        self._index: dict[tuple[int, int], int] = {}
        self._split = split

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            return _tensor, (self._describe(obj),)
        if kind in _PLAIN or obj is collections.OrderedDict or obj is _tensor:  # the class, the marker
            return NotImplemented
        raise _NotPlain(kind.__name__)

    def _describe(self, obj: torch.Tensor) -> tuple:
        if (obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized
                or obj.is_nested or obj.is_conj() or obj.is_neg()
                or any(getattr(obj, "names", ()))):  # named tensors (torch < 2.13): torch.save refuses them
            raise _NotPlain("tensor")
        storage = obj.untyped_storage()
        start, size, offset = 0, storage.nbytes(), int(obj.storage_offset())
        if size and storage.data_ptr() in self._split and obj.is_contiguous():
            # One of the snapshot's buffers, a piece of a block shared with the others: its
            # own bytes are its storage, so a restored tensor holds its own memory only.
            start, size, offset = offset * obj.element_size(), obj.numel() * obj.element_size(), 0
        key = (storage.data_ptr(), start)
        index = self._index.get(key) if size else None
        if index is None or self.storages[index][2] != size:
            index = len(self.storages)
            self.storages.append((storage, start, size))
            if size:
                self._index[key] = index
        dtype = str(obj.dtype).removeprefix("torch.")
        return (_TAG, index, size, dtype, offset, tuple(obj.shape), obj.stride(), obj.requires_grad)


class Plan:
    """What encoding one state writes: :meth:`pieces` yields its bytes in order, the storages'
    as views of the tensors' own memory. Holds the tensors until dropped."""

    def __init__(self, header: bytes, storages: list[Segment]) -> None:
        self._header, self._storages = header, storages

    def pieces(self) -> Iterator[bytes | memoryview]:
        """The bytes in order. Storages that lie back to back in one block of memory, each
        64-byte aligned there as in the file (the snapshot's buffers), go out as one piece:
        the bytes between them are the block's (zeros), where the file has its padding."""
        offset = len(self._header)
        yield self._header
        run: tuple[torch.UntypedStorage, int, int] | None = None  # block, start, end
        for storage, start, size in self._storages:
            pad = _padding(offset)
            if (run is not None and size and start == run[2] + pad
                    and storage.data_ptr() == run[0].data_ptr()):  # the same block
                run = (storage, run[1], start + size)
            else:
                if run is not None:
                    yield _memory(run[0])[run[1]:run[2]]
                    run = None
                if pad:
                    yield bytes(pad)
                if size:
                    run = (storage, start, start + size)
            offset += pad + size
        if run is not None:
            yield _memory(run[0])[run[1]:run[2]]


def plan(obj: Any, split: Collection[int] = ()) -> Plan | None:
    """The lean encoding of ``obj``, or ``None`` where it holds more than plain containers,
    scalars and dense CPU tensors (write it with ``torch.save`` then).

    ``split``: the memory (``data_ptr`` of storages) of blocks holding many tensors side by
    side, each written as a storage of its own (a contiguous tensor's own bytes), not the
    whole block: :class:`~lockstep.checkpoint.snapshot.Snapshot`'s arenas.
    """
    buffer = io.BytesIO()
    buffer.write(_LENGTH.pack(0))
    pickler = _Pickler(buffer, split)
    try:
        pickler.dump((sys.byteorder, obj))
    except _NotPlain:
        return None
    header = buffer.getbuffer()
    header[:_LENGTH.size] = _LENGTH.pack(len(header) - _LENGTH.size)
    return Plan(bytes(header), pickler.storages)


class _Unpickler(pickle.Unpickler):
    """Resolves no global but ``collections.OrderedDict`` and the tensor marker, which builds
    from :class:`_Tensors` (as does a persistent id, what earlier versions wrote)."""

    def __init__(self, data: bytes, tensors: _Tensors) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == (__name__, _tensor.__name__):
            return self._tensors.build
        raise ValueError(f"it refers to {module}.{name}; lockstep checkpoints hold none")

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors.build(pid)


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if isinstance(found, torch.dtype):
        return found
    raise ValueError(f"it names an unknown tensor dtype {name!r}")


def _extent(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements of storage a view of ``shape`` and ``stride`` from ``offset`` reaches."""
    if any(n == 0 for n in shape):
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def _naturals(values: Any, count: int | None = None) -> bool:
    return (isinstance(values, tuple) and (count is None or len(values) == count)
            and all(type(v) is int and v >= 0 for v in values))


class _Tensors:
    """The storages of one file, allocated as the pickle names them (never more bytes than the
    file holds), and the tensors viewing them."""

    def __init__(self, start: int, length: int) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self._end, self._length = start, length  # where the storages named so far end

    def build(self, pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 8 and pid[0] == _TAG):
            raise ValueError("it holds an unknown persistent object")
        _, index, size, dtype_name, offset, shape, stride, requires_grad = pid
        if not (_naturals((index, size, offset)) and _naturals(shape)
                and _naturals(stride, len(shape)) and type(requires_grad) is bool):
            raise ValueError("it describes a tensor with bad sizes")
        dtype = _dtype(dtype_name)
        if index == len(self.storages):
            self._end += _padding(self._end) + size
            if self._end > self._length:
                raise ValueError("its tensors need more bytes than the file holds")
            self.storages.append(torch.empty(size, dtype=torch.uint8).untyped_storage())
        elif index > len(self.storages) or self.storages[index].nbytes() != size:
            raise ValueError("it describes a tensor's storage inconsistently")
        storage = self.storages[index]
        if _extent(shape, stride, offset) * dtype.itemsize > size:
            raise ValueError("it has a tensor reaching past the end of its storage")
        tensor = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        return tensor.requires_grad_(requires_grad)


def read(readinto: Callable[[memoryview], int], length: int) -> tuple[Any, int]:
    """Rebuild the state whose lean encoding is the next ``length`` bytes ``readinto`` gives;
    also the CRC-32 of every byte read.

    Raises:
        ValueError: the bytes are not such an encoding (truncated, damaged, or written to run
            code); the caller compares the CRC-32 to tell a damaged file from a crafted one.
    """
    crc, consumed = 0, 0

    def fill(view: memoryview) -> None:
        nonlocal crc, consumed
        done = 0
        while done < len(view):
            got = readinto(view[done:])
            if not got:
                raise ValueError(f"it ends after {consumed + done} of {length} bytes")
            done += got
        crc = zlib.crc32(view, crc)
        consumed += len(view)

    if length < _LENGTH.size:
        raise ValueError("it is too short to hold a state")
    head = memoryview(bytearray(_LENGTH.size))
    fill(head)
    (size,) = _LENGTH.unpack(head)
    if size > length - consumed:
        raise ValueError("its structure is longer than the file")
    data = memoryview(bytearray(size))
    fill(data)
    tensors = _Tensors(consumed, length)
    try:
        byteorder, obj = _Unpickler(bytes(data), tensors).load()
    except ValueError:
        raise
    except Exception as exc:  # any unpickling failure: a damaged or foreign structure
        raise ValueError(f"its structure does not unpickle ({type(exc).__name__}: {exc})") from exc
    if byteorder != sys.byteorder:
        raise ValueError(f"it was written on a {byteorder}-endian machine; this one is {sys.byteorder}-endian")
    pad = bytearray(_ALIGN)
    for storage in tensors.storages:
        fill(memoryview(pad)[:_padding(consumed)])
        fill(_memory(storage))
    if consumed != length:
        raise ValueError(f"it holds {length - consumed} bytes past its last tensor")
    return obj, crc
