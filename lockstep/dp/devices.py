"""How DataParallel names and checks devices: torch's convention, an int is a CUDA index and -1 the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep.distributed import DeviceUnavailableError

__all__ = ["DeviceLike", "as_device", "cuda_asked_without_cuda", "resolve_device_ids", "resolve_output_device"]

DeviceLike = torch.device | str | int


def as_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``: ``0`` is ``cuda:0``, ``-1`` is the CPU, strings as torch reads them."""
    if isinstance(device, int):
        return torch.device("cpu") if device == -1 else torch.device("cuda", device)
    return torch.device(device)


def cuda_asked_without_cuda(device_ids: Sequence[DeviceLike] | None, output_device: DeviceLike | None) -> bool:
    """Whether only CUDA devices are named on a machine where CUDA is not available.

    torch's ``DataParallel`` then ignores ``device_ids`` and ``output_device`` and runs the module
    as it is (a script written for GPUs still runs on a laptop); :class:`DataParallel` does the
    same, with a warning. Lists that name the CPU, or a malformed list, are left to
    :func:`resolve_device_ids` to check.
    """
    if torch.cuda.is_available():
        return False
    named = [] if device_ids is None else list(device_ids)
    if output_device is not None:
        named.append(output_device)
    try:
        types = {as_device(d).type for d in named}
    except (RuntimeError, TypeError):
        return False
    return types == {"cuda"}


def resolve_device_ids(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    """``device_ids`` as devices, checked: one device type, every device present.

    Raises:
        ValueError: empty, mixed types, a device type other than cpu/cuda, or a missing GPU.
    """
    if device_ids is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    try:
        devices = [as_device(d) for d in device_ids]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device_ids={list(device_ids)!r} holds something that is not a device: {exc}"
        ) from exc
    if not devices:
        raise ValueError(
            "device_ids is empty; pass at least one device, e.g. [0, 1] or ['cpu', 'cpu']"
        )
    types = sorted({d.type for d in devices})
    if len(types) > 1:
        raise ValueError(f"device_ids mixes device types {types}; one DataParallel drives one kind "
                         "of device (use only GPUs, or only 'cpu')")
    if types[0] == "cpu":
        return [torch.device("cpu") for _ in devices]
    if types[0] != "cuda":
        raise ValueError(f"DataParallel drives 'cuda' or 'cpu' devices, not {types[0]!r}")
    return [_check_cuda(d) for d in devices]


def _check_cuda(device: torch.device) -> torch.device:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.index if device.index is not None else (torch.cuda.current_device() if count else 0)
    if index >= count:
        raise DeviceUnavailableError(f"device_ids names cuda:{index} but {count} CUDA device(s) are visible; "
                         "check CUDA_VISIBLE_DEVICES or pass existing indices")
    return torch.device("cuda", index)


def resolve_output_device(output_device: DeviceLike | None, src: torch.device) -> torch.device:
    """Where outputs are gathered: ``src`` by default, the CPU for ``-1``, else a checked GPU."""
    if output_device is None:
        return src
    device = as_device(output_device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != src.type:
        raise ValueError(f"output_device={output_device!r} is neither the CPU nor a {src.type} device "
                         "like device_ids; pass one of device_ids or -1 for the CPU")
    return _check_cuda(device)
