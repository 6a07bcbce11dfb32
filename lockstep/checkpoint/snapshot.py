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

from lockstep.checkpoint.deferred import DeferredCopy, storage_key

__all__ = ["Snapshot"]


class Snapshot:
    """Copies nested containers of tensors into host buffers that are reused between saves."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}  # one side stream per CUDA device
        self.nbytes = 0  # bytes of tensor data held by the last snapshot

    def take(
        self, files: Mapping[str, Any], defer: Collection[tuple[str, int]] = (), step: int | None = None
    ) -> tuple[dict[str, Any], DeferredCopy]:
        """A deep copy of ``files`` whose tensors live in this object's host buffers.

        Containers are copied (dicts, lists, tuples); numbers, strings and ``None`` are shared
        (they are immutable). Only what ``check_loadable`` accepts may be passed.

        Args:
            files: file name -> content, still referencing the live tensors.
            defer: the memory (``deferred.storage_key``) whose copy may finish later.
            step: the step saved, for the error message of a changed tensor.

        Returns:
            The copy, and the copies still to do: its buffers hold the data once
            ``DeferredCopy.run`` returned.
        """
        used: dict[str, torch.Tensor] = {}
        now: list[tuple[torch.Tensor, torch.Tensor]] = []  # CUDA copies that save() waits for
        later: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        out = {name: self._copy(value, name, used, now, (defer, later))
               for name, value in files.items()}
        streams = self._queue(now)
        for stream in streams:
            stream.synchronize()  # the copy exists before the loop may change the originals
        on_cuda = [(source, buffer) for _, source, buffer in later if source.device.type == "cuda"]
        events = [stream.record_event() for stream in self._queue(on_cuda)]  # not waited for
        self._buffers = used  # drop buffers of tensors that are gone
        self.nbytes = sum(t.numel() * t.element_size() for t in used.values())
        return out, DeferredCopy(later, events, step)

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

    def _copy(self, obj: Any, path: str, used: dict[str, torch.Tensor], now: list,
              later: tuple[Collection, list]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used, now, later)
        if isinstance(obj, dict):
            copied = {k: self._copy(v, f"{path}/{k}", used, now, later)
                      for k, v in obj.items()}
            return type(obj)(copied) if type(obj) is not dict else copied
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", used, now, later) for i, v in enumerate(obj)]
            return type(obj)(items)
        return obj

    def _copy_tensor(
        self, tensor: torch.Tensor, path: str, used: dict[str, torch.Tensor], now: list,
        later: tuple[Collection, list],
    ) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        used[path] = buffer
        defer, jobs = later
        if defer and storage_key(tensor) in defer:
            jobs.append((path, tensor, buffer))  # copied by DeferredCopy, after save() returns
        elif tensor.device.type == "cuda":
            now.append((tensor, buffer))  # queued together once the walk is done
        else:
            buffer.copy_(tensor)
        return buffer

    def _side_stream(self, device: torch.device) -> Any:
        """This device's side stream (made once, reused by every save), after the current
        stream's pending work (the writes to the weights) has been queued before it."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream
