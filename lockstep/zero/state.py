"""Optimizer state dicts between one rank's shard and the whole model.

The consolidated form is exactly a plain optimizer's ``state_dict()``: state keyed by the
parameter's position over all groups, ``param_groups`` listing those positions. So a
checkpoint written at one world size loads at any other, or into a plain optimizer.
Pure logic, no communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "check_compatible",
    "full_state_dict",
    "global_indices",
    "local_state_dict",
    "shard_state"
]


def global_indices(group_lengths: Sequence[int]) -> list[list[int]]:
    """Each parameter's position over all groups, as ``Optimizer.state_dict`` numbers them."""
    out, start = [], 0
    for length in group_lengths:
        out.append(list(range(start, start + length)))
        start += length
    return out


def shard_state(local_state: Mapping[int, dict], local_to_global: Sequence[int]) -> dict[int, dict]:
    """Re-key a shard optimizer's ``state_dict()["state"]`` by global position, copied to CPU.

    The copy makes the result a snapshot (optimizers update state in place) that any rank can
    unpickle, whatever device it has.
    """
    return {
        local_to_global[local]: {key: _to_cpu(value) for key, value in per_param.items()}
        for local, per_param in local_state.items()
    }


def full_state_dict(param_groups: Sequence[dict], state: Mapping[int, dict]) -> dict[str, Any]:
    """The plain-optimizer state dict for these groups, given every parameter's state."""
    lengths = [len(group["params"]) for group in param_groups]
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": indices}
        for group, indices in zip(param_groups, global_indices(lengths))
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def local_state_dict(
    full: Mapping[str, Any], owned: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The state dict of a shard optimizer whose group ``g`` holds positions ``owned[g]``."""
    state = full["state"]
    groups = []
    local_state: dict[int, Any] = {}
    local = 0
    for saved, positions in zip(full["param_groups"], owned):
        params = []
        for position in positions:
            if position in state:
                local_state[local] = state[position]
            params.append(local)
            local += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": params})
    return {"state": local_state, "param_groups": groups}


def check_compatible(full: Mapping[str, Any], group_lengths: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``full`` has the same groups, of the same lengths.

    Raises:
        ValueError: a key is missing, or the number or sizes of the groups differ.
    """
    missing = [key for key in ("state", "param_groups") if key not in full]
    if missing:
        raise ValueError(
            f"optimizer state dict lacks {missing}; pass what consolidate_state_dict() followed by "
            "state_dict() returned, or a plain optimizer's state_dict()"
        )
    saved = [len(group["params"]) for group in full["param_groups"]]
    if len(saved) != len(group_lengths):
        raise ValueError(
            f"loaded state dict has {len(saved)} parameter groups, this optimizer has "
            f"{len(group_lengths)}; add the same groups in the same order before loading"
        )
    for index, (theirs, ours) in enumerate(zip(saved, group_lengths)):
        if theirs != ours:
            raise ValueError(
                f"parameter group {index} has {theirs} parameters in the loaded state dict but "
                f"{ours} in this optimizer; build the same model and groups before loading"
            )


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value
