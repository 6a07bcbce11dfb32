"""The part of an asynchronous save's copy that finishes while the loop trains on (issue #24).

Copying the whole state into host memory costs about as much as ``torch.save`` into the page
cache, so :meth:`Checkpointer.save` copies at once only what the next forward/backward may
change (buffers such as BatchNorm statistics, RNG states, samplers, schedulers, plain values)
and defers the copy of what only an optimizer step changes: the parameters and the state of the
optimizers passed to the same ``save()``. Those copies run in the background (CPU: in the
writing thread; CUDA: on a side stream, not synchronised) and are completed before:

- the next ``step()`` of each of those optimizers (a step pre-hook, a no-op once it fired and
  removed at the next checkpoint call: torch iterates the hooks while calling them);
- the next ``save()``, ``wait()``, ``restore()`` (and a SIGTERM, and the end of the process);
- the writing thread encodes the buffers.

Something else may still write into a parameter before the next step (an EMA written back, a
clamp, ``load_state_dict``). Each source tensor's version counter is recorded when ``save()``
starts and compared once the copy is complete, on the thread that called ``save()`` (at the
step, or the next checkpoint call), where every earlier write has been counted: a changed
counter fails the save, naming the tensor, like a failed write (raised by the next call on every
rank, the previous checkpoint stays the newest). Until that check passed, the writing thread
may write the staging directory but does not publish it. If that thread outlives the one that
saved (a script that returns right after ``save()``), it checks the counters itself.

The CPU copies are split into pieces (small tensors together up to ``_CHUNK_BYTES``, each
copied by one call; a larger tensor in chunks of that size) that any thread claims, one at a
time, under a lock (:class:`CopyPieces`): the writing thread claims them first, and a thread
that must wait for the copy (the step, the next checkpoint call) claims the rest instead of
idling, then waits only for the pieces in flight. A model of a few hundred small tensors is a
few pieces, not a few hundred: each piece costs both threads Python under the GIL.

Writes that autograd does not count (through ``tensor.data``, NumPy views) cannot be seen: code
that writes parameters that way must call ``wait()`` first, or save with ``defer_copy=False``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lockstep._torch_compat import copy_tensors, tensor_version

__all__ = ["CopyPieces", "DeferredCopy", "pieces", "split", "stepped_storages", "stepping_optimizers"]

_POLL_S = 0.02  # how often the writing thread looks whether the thread that saved is alive
# A larger tensor is copied in pieces of this size, and smaller ones together up to it, so that
# two threads can share the copy.
_CHUNK_BYTES = 2 * 2**20
_ORPHAN = -1  # the owner of a piece whose copy was interrupted: any waiting thread copies it


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """What identifies ``tensor``'s memory across views (``None``: empty, or no plain storage,
    as a sparse tensor or a DTensor: such a tensor is copied at once). Called twice per tensor
    of every save: kept to a few attribute reads."""
    if type(tensor) not in _PLAIN_TENSORS or tensor.layout is not torch.strided:
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (tensor.device, ptr) if ptr else None


def stepping_optimizers(objects: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among the objects of a save (a ZeRO optimizer is one)."""
    return [obj for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)]


def stepped_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[torch.device, int]]:
    """The memory that only a step of ``optimizers`` changes: their parameters and state."""
    keys: set[tuple[torch.device, int] | None] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            keys.update(storage_key(p) for p in group["params"])
        for state in optimizer.state.values():
            keys.update(storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    keys.discard(None)
    return keys  # type: ignore[return-value]


def split(source: torch.Tensor, buffer: torch.Tensor,
          chunk_bytes: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(source, buffer)`` as ``(source part, buffer part)`` pairs of at most ``chunk_bytes``
    (default ``_CHUNK_BYTES``); one pair when either tensor is not contiguous."""
    numel = max(1, (chunk_bytes or _CHUNK_BYTES) // buffer.element_size())
    if buffer.numel() <= numel or not (source.is_contiguous() and buffer.is_contiguous()):
        return [(source, buffer)]
    flat_source, flat_buffer = source.view(-1), buffer.view(-1)
    return [(flat_source[i:i + numel], flat_buffer[i:i + numel])
            for i in range(0, flat_buffer.numel(), numel)]


Piece = tuple[list[torch.Tensor], list[torch.Tensor]]  # sources, buffers: copied by one call


def pieces(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
           chunk_bytes: int | None = None) -> list[Piece]:
    """``(source, buffer)`` pairs as pieces of about ``chunk_bytes`` (default ``_CHUNK_BYTES``):
    consecutive smaller tensors together, a larger one :func:`split` into its own pieces."""
    limit = chunk_bytes or _CHUNK_BYTES
    out: list[Piece] = []
    sources: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    held = 0
    for source, buffer in pairs:
        size = buffer.numel() * buffer.element_size()
        if size >= limit or held + size > limit:
            if sources:
                out.append((sources, buffers))
            sources, buffers, held = [], [], 0
        if size >= limit:
            out.extend(([part], [into]) for part, into in split(source, buffer, limit))
            continue
        sources.append(source)
        buffers.append(buffer)
        held += size
    if sources:
        out.append((sources, buffers))
    return out


class CopyPieces:
    """CPU copies (:func:`pieces`) that any thread may claim, one piece at a time.

    :meth:`work` claims and copies pieces until none is left, then waits for those that other
    threads are copying: the writing thread calls it, and so does a thread that must wait for the
    copy, which then takes the pieces the writing thread has not reached (issue #24). Copies are
    idempotent, so a piece whose copy was interrupted (a signal handler that waits for the copy
    on the thread that was copying it, a ``KeyboardInterrupt``) is copied again by a waiter.
    """

    def __init__(self, parts: list[Piece]) -> None:
        self._pieces = parts
        self._owners: list[int | None] = [None] * len(parts)  # thread that claimed each piece
        self._done = [False] * len(parts)
        self._next = 0  # the first piece not claimed yet
        self._cond = threading.Condition(threading.RLock())  # a signal handler may re-enter
        self.failure: Exception | None = None  # the first copy that raised

    def work(self) -> None:
        """Copy unclaimed pieces until none is left, then wait for the others' (never raises
        a copy's error: see :attr:`failure`)."""
        while (index := self._claim()) is not None:
            self._copy(index)
        me = threading.get_ident()
        for index in range(len(self._done)):
            with self._cond:
                while not self._done[index] and self._owners[index] not in (me, _ORPHAN):
                    self._cond.wait()
                mine = not self._done[index]  # claimed by a frame of this thread left unfinished
            if mine:
                self._copy(index)

    def release(self) -> None:
        """Drop the references to the sources and buffers (call once :meth:`work` returned)."""
        self._pieces = []

    def _claim(self) -> int | None:
        with self._cond:
            index = self._next
            if index == len(self._owners):
                return None
            self._owners[index] = threading.get_ident()  # before the index moves: see work()
            self._next = index + 1
            return index

    def _copy(self, index: int) -> None:
        sources, buffers = self._pieces[index]
        try:
            copy_tensors(buffers, sources)  # releases the GIL: the other threads copy meanwhile
        except Exception as exc:  # noqa: BLE001 - raised on the writing thread (DeferredCopy.run)
            with self._cond:
                self.failure = self.failure or exc
        except BaseException:  # interrupted: left to whichever thread waits for it
            with self._cond:
                self._owners[index] = _ORPHAN
                self._cond.notify_all()
            raise
        with self._cond:
            self._done[index] = True
            self._cond.notify_all()


class DeferredCopy:
    """Copies of ``(name, source, host buffer)`` finishing after ``save()`` returned.

    CUDA copies are queued by :meth:`Snapshot.take` on its side streams (``events`` mark their
    end); CPU copies are made by :meth:`run`, which the writing thread calls first, and by
    :meth:`check` for what ``run`` has not reached yet. Build it on the thread that saves, before
    anything else may write into the sources.
    """

    def __init__(self, jobs: list[tuple[str, torch.Tensor, torch.Tensor]], events: list[Any],
                 step: int | None = None) -> None:
        self._jobs = jobs
        self._pieces = CopyPieces(pieces((source, buffer) for _, source, buffer in jobs
                                         if source.device.type != "cuda"))
        self.nbytes = sum(buf.numel() * buf.element_size() for _, _, buf in jobs)  # copied later
        self._versions = [tensor_version(source) for _, source, _ in jobs]
        self._events = events
        self._step = step
        self._saver = threading.current_thread()
        self._copied = threading.Event()
        self._checked = threading.Event()
        self._lock = threading.RLock()  # a SIGTERM handler may check inside a check
        self._hooks: list[Any] = []
        self.error: str | None = None  # set by check(): which tensor changed
        if not jobs:
            self._copied.set()
            self._checked.set()

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Complete and check the copy before the next step of each of ``optimizers``."""
        if self._checked.is_set():
            return
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.check()  # a failure is raised by the next checkpoint call, not by the step

    def run(self) -> None:
        """Do the CPU copies and wait for the CUDA ones (the writing thread, before encoding).

        Raises:
            Exception: the first CPU copy that failed, on this thread or one that helped.
        """
        try:
            self._pieces.work()
            for event in self._events:
                event.synchronize()
        finally:
            self._copied.set()
        if self._pieces.failure is not None:
            raise self._pieces.failure

    def check(self) -> str | None:
        """Complete the copy, then compare the version counters; the error, if any.

        The CPU pieces the writing thread has not claimed yet are copied here rather than waited
        for; a failed copy is raised by :meth:`run`, not here (a step must not fail). CUDA
        copies are waited for as :meth:`run` synchronises them. Call it on the thread that saved
        (there every write before the call has been counted), or once that thread has ended.
        """
        self._pieces.work()
        if self._events:
            self._copied.wait()
        with self._lock:
            if not self._checked.is_set():
                self.error = self._changed()
                self._jobs = []  # keep no parameter alive
                self._pieces.release()
                self._checked.set()
        return self.error

    def _changed(self) -> str | None:
        for (name, source, _), before in zip(self._jobs, self._versions):
            if tensor_version(source) != before:
                at = f"save(step={self._step})" if self._step is not None else "save()"
                return (
                    f"{name} was changed in place after {at} returned and before its copy was "
                    "checked (at the next optimizer step): the checkpoint would mix old and new "
                    "values, so it was not published. Call ckpt.wait() before changing "
                    "parameters or optimizer state outside optimizer.step() (EMA, clamping, "
                    "load_state_dict), or save with blocking=True, or build the Checkpointer "
                    "with defer_copy=False"
                )
        return None

    def checked(self) -> str | None:
        """Wait until :meth:`check` ran (the writing thread, before publishing); its error.

        If the thread that saved ends first, nothing can write the sources any more: check now.
        """
        while not self._checked.wait(_POLL_S):
            if not self._saver.is_alive():
                return self.check()
        return self.error

    def remove_hooks(self) -> None:
        """Remove the step hooks (outside any ``step()``: the next checkpoint call)."""
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()

