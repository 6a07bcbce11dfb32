"""How DataParallel names devices: torch's convention, where an int is a CUDA index and -1 the CPU."""

from __future__ import annotations

import torch

__all__ = ["DeviceLike", "as_device"]

DeviceLike = torch.device | str | int


def as_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``: ``0`` is ``cuda:0``, ``-1`` is the CPU, strings as torch reads them."""
    if isinstance(device, int):
        return torch.device("cpu") if device == -1 else torch.device("cuda", device)
    return torch.device(device)
