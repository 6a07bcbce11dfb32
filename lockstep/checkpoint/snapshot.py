"""A consistent copy of what a save writes, taken in memory so the disk write can run later.

An asynchronous :meth:`Checkpointer.save` returns once this copy exists, or is sure to exist
before anything can change it: from then on the training loop may change the weights, the
optimizer state, the RNG... while a background thread encodes and writes the copy (see
``background.py``). The copy costs host memory equal to the tensors this rank writes (rank 0: the
model and the optimizer state, plus its shard if any; other ranks: their shard and RNG states),
held from one save to the next; its buffers are reused by the next save when the shapes and
dtypes are unchanged, so a run allocates them once.

Tensors in memory that only an optimizer step changes (``defer``: parameters and optimizer
state) are copied later, while the loop trains on: :class:`deferred.DeferredCopy` (issue #24).
The others are copied before :meth:`Snapshot.take` returns. CUDA tensors are copied into pinned
host buffers with non-blocking copies on a side stream that first waits for the current stream;
the stream is synchronised after the immediate copies, before the deferred ones are queued.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from lockstep._torch_compat import copy_tensors
from lockstep.checkpoint.deferred import DeferredCopy, storage_key
from lockstep.checkpoint.io import SCALARS

__all__ = ["Snapshot"]


_ALIGN = 64  # where each buffer starts in its file's arena (any dtype's alignment)
_ARENA_BYTES = 64 * 2**20  # the most one arena holds (a power of two: see Snapshot._lay_out)


# Where a tensor sits in a save: the file, then each key or index on the way (kept apart, not
# joined: "loss/train" and {"loss": {"train": ...}}, or 0 and "0", are different places).
Path = tuple[Any, ...]


def path_name(path: Path) -> str:
    """``path`` for a message: ``state.pt/objects/model/0.weight``."""
    return "/".join(map(str, path))


class _Misfit(Exception):
    """A tensor has no buffer of its path, shape and dtype: the arenas are laid out again."""


class _Walk:
    """What one :meth:`Snapshot.take` gathers while it walks the containers."""

    __slots__ = ("defer", "here", "later", "now", "used")

    def __init__(self, defer: Collection[tuple[torch.device, int]]) -> None:
        self.defer = defer
        self.used: dict[Path, torch.Tensor] = {}  # path -> the buffer this save copies into
        self.now: list[tuple[torch.Tensor, torch.Tensor]] = []  # CUDA copies save() waits for
        self.here: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # CPU: sources, buffers
        self.later: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # DeferredCopy's


class Snapshot:
    """Copies nested containers of tensors into host buffers that are reused between saves.

    The buffers of one file are views into one block of host memory, its arena (pinned when the
    file holds CUDA tensors), laid out when a save finds a tensor without a buffer of its path,
    shape and dtype, or a tensor gone; later saves reuse it. A file of a few hundred tensors
    then has one storage, which its encoding writes and checksums as one piece (``tensorfile``)
    instead of a few hundred, each with its own Python calls on a thread that shares the GIL
    with training (issue #24).
    """

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._arenas: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}  # one side stream per CUDA device
        self.nbytes = 0  # bytes of host memory held by the snapshot's buffers

    def blocks(self) -> frozenset[int]:
        """The memory (``data_ptr``) of the blocks the buffers are views of: the encoding
        writes each buffer as a storage of its own (``tensorfile.plan``'s ``split``), so a
        restored tensor does not keep a whole file's block alive."""
        return frozenset(arena.untyped_storage().data_ptr() for arena in self._arenas)

    def take(
        self, files: Mapping[str, Any], defer: Collection[tuple[torch.device, int]] = (), step: int | None = None
    ) -> tuple[dict[str, Any], DeferredCopy]:
        """A deep copy of ``files`` whose tensors live in this object's host buffers.

        Containers are copied (dicts, lists, tuples); numbers, strings and ``None`` are shared
        (they are immutable). Only what ``check_loadable`` accepts may be passed. The buffers
        may be reused once the previous copy is no longer read (its write has finished).

        Args:
            files: file name -> content, still referencing the live tensors.
            defer: the memory (``deferred.storage_key``) whose copy may finish later.
            step: the step saved, for the error message of a changed tensor.

        Returns:
            The copy, and the copies still to do: its buffers hold the data once
            ``DeferredCopy.run`` returned.
        """
        try:
            out, walk = self._walk(files, defer)
            fits = True
        except _Misfit:
            fits = False
        if not fits:  # new tensors, other shapes, or some gone: lay out, copy everything again
            self._lay_out(files)  # (outside the handler, whose traceback holds the old buffers)
            out, walk = self._walk(files, defer)
        copy_tensors(walk.here[1], walk.here[0])  # the CPU copies that cannot wait, in one call
        streams = self._queue(walk.now)
        for stream in streams:
            stream.synchronize()  # the copy exists before the loop may change the originals
        on_cuda = [(source, buffer) for _, source, buffer in walk.later if source.device.type == "cuda"]
        events = [stream.record_event() for stream in self._queue(on_cuda)]  # not waited for
        return out, DeferredCopy(walk.later, events, step)

    def _walk(self, files: Mapping[str, Any],
              defer: Collection[tuple[torch.device, int]]) -> tuple[dict[str, Any], _Walk]:
        walk = _Walk(defer)
        out = {name: self._copy(value, (name,), walk) for name, value in files.items()}
        if len(walk.used) != len(self._buffers):
            raise _Misfit("a tensor is gone")  # its arena would hold (and write) its bytes
        return out, walk

    def _lay_out(self, files: Mapping[str, Any]) -> None:
        """Each file's tensors as views into arenas, at 64-byte aligned offsets.

        An arena holds at most ``_ARENA_BYTES`` (a tensor larger than that has one of its own):
        pinned memory is allocated in powers of two by torch's host allocator, so one block of
        a whole model's size could cost up to twice that; blocks of exactly a power of two cost
        what they hold.
        """
        self._buffers, self._arenas, self.nbytes = {}, [], 0  # the old arenas go first
        for name, value in files.items():
            specs: list[tuple[Path, torch.Tensor]] = []
            _tensors(value, (name,), specs)
            pin = any(tensor.device.type == "cuda" for _, tensor in specs)
            for path, tensor in specs:
                if not tensor.numel():  # no bytes: not in an arena (where it would need aligning)
                    self._buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype)
            for block in _blocks([(path, tensor) for path, tensor in specs if tensor.numel()]):
                total = block[-1][2] + block[-1][1].numel() * block[-1][1].element_size()
                # zeros: the bytes between buffers are written as the file's padding
                arena = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
                self._arenas.append(arena)
                for path, tensor, offset in block:
                    size = tensor.numel() * tensor.element_size()
                    self._buffers[path] = arena[offset:offset + size].view(tensor.dtype).view(tensor.shape)
                self.nbytes += total

    def _queue(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        """Queue ``(source, host buffer)`` CUDA copies on each device's side stream, in order.

        One stream context per device, not one per tensor: entering a stream context costs
        tens of microseconds of Python, which a save of a few hundred tensors every step pays
        on the training thread (issue #24). Returns the streams used.
        """
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for source, buffer in copies:
            by_device.setdefault(source.device, []).append((source, buffer))
        streams = []
        for device, pairs in by_device.items():
            stream = self._side_stream(device)
            with torch.cuda.stream(stream):
                for source, buffer in pairs:
                    buffer.copy_(source, non_blocking=True)
            streams.append(stream)
        return streams

    def _copy(self, obj: Any, path: Path, walk: _Walk) -> Any:
        # Immutable scalars inside a container are shared without a call or a path: a state has
        # hundreds (an optimizer's parameter indices, its hyperparameters), copied every save.
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, walk)
        if isinstance(obj, dict):
            copied = {k: v if type(v) in SCALARS else self._copy(v, (*path, k), walk)
                      for k, v in obj.items()}
            return type(obj)(copied) if type(obj) is not dict else copied
        if isinstance(obj, (list, tuple)):
            items = [v if type(v) in SCALARS else self._copy(v, (*path, i), walk)
                     for i, v in enumerate(obj)]
            return type(obj)(items)
        return obj

    def _copy_tensor(self, tensor: torch.Tensor, path: Path, walk: _Walk) -> torch.Tensor:
        if not _in_arena(tensor):
            return _copied_whole(tensor)
        if tensor.requires_grad:  # (a state dict's tensors are detached already)
            tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            raise _Misfit(path_name(path))
        walk.used[path] = buffer
        if walk.defer and storage_key(tensor) in walk.defer:
            walk.later.append((path_name(path), tensor, buffer))  # copied by DeferredCopy, later
        elif tensor.device.type == "cuda":
            walk.now.append((tensor, buffer))  # queued together once the walk is done
        else:
            walk.here[0].append(tensor)
            walk.here[1].append(buffer)
        return buffer

    def _side_stream(self, device: torch.device) -> Any:
        """This device's side stream (made once, reused by every save), after the current
        stream's pending work (the writes to the weights) has been queued before it."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream




def _in_arena(tensor: torch.Tensor) -> bool:
    """A plain dense tensor: its bytes go to a reused buffer. A sparse one, or an
    ``nn.Parameter``, is copied whole instead, keeping its layout and its class (the file
    writes them with ``torch.save``, as a blocking save does)."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided


def _copied_whole(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.detach().to("cpu", copy=True)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy


def _tensors(obj: Any, path: Path, found: list[tuple[Path, torch.Tensor]]) -> None:
    """Append ``(path, tensor)`` for each tensor of ``obj``, in :meth:`Snapshot._copy`'s order
    and with its paths."""
    if isinstance(obj, torch.Tensor):
        if _in_arena(obj):
            found.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, (*path, k), found)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, (*path, i), found)


def _blocks(specs: list[tuple[Path, torch.Tensor]]) -> list[list[tuple[Path, torch.Tensor, int]]]:
    """``specs`` cut into arenas of at most ``_ARENA_BYTES``, in order: each ``(path, tensor,
    offset in its arena)``; a tensor of more than ``_ARENA_BYTES`` is an arena alone."""
    blocks: list[list[tuple[Path, torch.Tensor, int]]] = []
    end = _ARENA_BYTES + 1  # no arena open yet
    for path, tensor in specs:
        size = tensor.numel() * tensor.element_size()
        offset = end + -end % _ALIGN
        if offset + size > _ARENA_BYTES:
            blocks.append([])
            offset = 0
        blocks[-1].append((path, tensor, offset))
        end = offset + size
    return blocks
