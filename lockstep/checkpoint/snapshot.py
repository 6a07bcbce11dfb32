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
        streams: list[Any] = []
        later: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        out = {name: self._copy(value, name, used, streams, (defer, later))
               for name, value in files.items()}
        for stream in streams:
            stream.synchronize()  # the copy exists before the loop may change the originals
        on_cuda = [(source, buffer) for _, source, buffer in later if source.device.type == "cuda"]
        for source, buffer in on_cuda:  # queued behind the immediate copies, not waited for
            with torch.cuda.stream(self._side_stream(source.device, streams)):
                buffer.copy_(source, non_blocking=True)
        events = [stream.record_event() for stream in streams] if on_cuda else []
        self._buffers = used  # drop buffers of tensors that are gone
        self.nbytes = sum(t.numel() * t.element_size() for t in used.values())
        return out, DeferredCopy(later, events, step)

    def _copy(self, obj: Any, path: str, used: dict[str, torch.Tensor], streams: list,
              later: tuple[Collection, list]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used, streams, later)
        if isinstance(obj, dict):
            copied = {k: self._copy(v, f"{path}/{k}", used, streams, later)
                      for k, v in obj.items()}
            return type(obj)(copied) if type(obj) is not dict else copied
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", used, streams, later) for i, v in enumerate(obj)]
            return type(obj)(items)
        return obj

    def _copy_tensor(
        self, tensor: torch.Tensor, path: str, used: dict[str, torch.Tensor], streams: list,
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
            stream = self._side_stream(tensor.device, streams)
            with torch.cuda.stream(stream):
                buffer.copy_(tensor, non_blocking=True)
        else:
            buffer.copy_(tensor)
        return buffer

    @staticmethod
    def _side_stream(device: torch.device, streams: list) -> Any:
        for stream in streams:
            if stream.device == device:
                return stream
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # pending writes to the weights
        streams.append(stream)
        return stream
