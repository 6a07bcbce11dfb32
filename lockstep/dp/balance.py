"""Warn when DataParallel's devices are unbalanced: the slowest device sets the pace.

Every replica gets an equal share of the batch, so a device with much less memory or far fewer
multiprocessors than the others makes the whole step wait for it (or runs out of memory first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["DeviceCapacity", "device_capacities", "imbalance_message"]

# A device below this share of the largest one's memory or multiprocessors is called out;
# the same threshold torch's DataParallel uses for its imbalance warning.
IMBALANCE_RATIO = 0.75


@dataclasses.dataclass(frozen=True)
class DeviceCapacity:
    """What a device can hold and how much it can compute at once."""

    device: torch.device
    total_memory: int
    multiprocessors: int


def device_capacities(devices: Sequence[torch.device]) -> list[DeviceCapacity]:
    """The capacity of each CUDA device in ``devices`` (CPU devices have none to compare)."""
    capacities = []
    for dev in devices:
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            capacities.append(DeviceCapacity(dev, props.total_memory, props.multi_processor_count))
    return capacities


def imbalance_message(
    capacities: Sequence[DeviceCapacity], ratio: float = IMBALANCE_RATIO
) -> str | None:
    """A warning naming the devices below ``ratio`` of the largest, with numbers; None when balanced.

    Example:
        >>> big = DeviceCapacity(torch.device("cuda", 0), 80 << 30, 132)
        >>> small = DeviceCapacity(torch.device("cuda", 1), 16 << 30, 40)
        >>> imbalance_message([big, small]).startswith("DataParallel devices are unbalanced")
        True
    """
    if len(capacities) < 2:
        return None
    max_mem = max(c.total_memory for c in capacities)
    max_sm = max(c.multiprocessors for c in capacities)
    weak = []
    for c in capacities:
        mem_share = c.total_memory / max_mem if max_mem else 1.0
        sm_share = c.multiprocessors / max_sm if max_sm else 1.0
        if mem_share < ratio or sm_share < ratio:
            weak.append(
                f"{c.device} has {c.total_memory / 2**30:.1f} GiB ({mem_share:.0%} of the largest)"
                f" and {c.multiprocessors} multiprocessors ({sm_share:.0%} of the most)"
            )
    if not weak:
        return None
    return (
        "DataParallel devices are unbalanced: " + "; ".join(weak) + ". Every replica gets an "
        "equal share of the batch, so the weakest device sets the pace; consider leaving it out "
        "of device_ids."
    )
