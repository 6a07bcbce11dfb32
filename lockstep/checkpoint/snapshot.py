"""A consistent copy of what a save writes, taken in memory so the disk write can run later.

An asynchronous :meth:`Checkpointer.save` returns once this copy exists: from then on the
training loop may change the weights, the optimizer state, the RNG... while a background thread
encodes and writes the copy (see ``background.py``). The copy costs host memory equal to the
tensors this rank writes (rank 0: the model and the optimizer state, plus its shard if any;
other ranks: their shard and RNG states), held from one save to the next; its buffers are reused
by the next save when the shapes and dtypes are unchanged, so a run allocates them once.

CUDA tensors are copied into pinned host buffers with non-blocking copies on a side stream that
first waits for the current stream; the copy is synchronised before :meth:`Snapshot.take`
returns, so the next optimizer step can never change what is being written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Snapshot"]


class Snapshot:
    """Copies nested containers of tensors into host buffers that are reused between saves."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.nbytes = 0  # bytes of tensor data held by the last snapshot

    def take(self, files: Mapping[str, Any]) -> dict[str, Any]:
        """A deep copy of ``files`` whose tensors live in this object's host buffers.

        Containers are copied (dicts, lists, tuples); numbers, strings and ``None`` are shared
        (they are immutable). Only what ``check_loadable`` accepts may be passed.
        """
        used: dict[str, torch.Tensor] = {}
        streams: list[Any] = []
        out = {name: self._copy(value, name, used, streams) for name, value in files.items()}
        for stream in streams:
            stream.synchronize()  # the copy exists before the loop may change the originals
        self._buffers = used  # drop buffers of tensors that are gone
        self.nbytes = sum(t.numel() * t.element_size() for t in used.values())
        return out

    def _copy(self, obj: Any, path: str, used: dict[str, torch.Tensor], streams: list) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used, streams)
        if isinstance(obj, dict):
            copied = {k: self._copy(v, f"{path}/{k}", used, streams) for k, v in obj.items()}
            return type(obj)(copied) if type(obj) is not dict else copied
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", used, streams) for i, v in enumerate(obj)]
            return type(obj)(items)
        return obj

    def _copy_tensor(
        self, tensor: torch.Tensor, path: str, used: dict[str, torch.Tensor], streams: list
    ) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        used[path] = buffer
        if tensor.device.type == "cuda":
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
