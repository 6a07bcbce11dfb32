"""Does a saved state fit the object it is restored into? Checked before loading.

torch's own ``load_state_dict`` checks little for optimizers (only the number of groups and of
parameters per group) and nothing for a model on the meta device, so a checkpoint of another
optimizer, or of other parameter shapes, loads and fails at the next ``step()`` far from its
cause, and a meta model "restores" without taking a single value. These checks name the file,
the object and what differs instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint.io import CheckpointError

__all__ = ["check_optimizer_fits", "refuse_meta"]

# torch's optimizers whose per-parameter state tensors all have their parameter's shape (or
# are scalars). Others (LBFGS's flat history, factored or sharded states) are not checked.
_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
    "Adadelta", "ASGD") if hasattr(torch.optim, name))
_MAX_LISTED = 5


def refuse_meta(model: nn.Module, source: str) -> None:
    """Raise if ``model`` holds parameters or buffers on the meta device (nothing to load into)."""
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers())
            if t.device.type == "meta"]
    if meta:
        shown = ", ".join(meta[:_MAX_LISTED]) + (f" and {len(meta) - _MAX_LISTED} more"
                                                 if len(meta) > _MAX_LISTED else "")
        raise CheckpointError(
            f"cannot restore {source} into a model on the meta device ({shown}): copying into "
            "meta tensors keeps no value. Materialise the model first (model.to_empty(device=...) "
            "then restore), or build it on a real device"
        )


def check_optimizer_fits(name: str, optimizer: torch.optim.Optimizer, state: Any, source: str) -> None:
    """Raise if ``state`` was saved by another kind of optimizer, or for other parameter shapes."""
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        return  # torch's load_state_dict says what is wrong with the form itself
    for index, (saved, group) in enumerate(zip(state["param_groups"], optimizer.param_groups)):
        if not isinstance(saved, Mapping):
            return
        extra = sorted(set(saved) - set(group) - {"params", "param_names"})
        lacking = sorted(set(group) - set(saved) - {"params", "param_names"})
        # A newer torch only adds settings (loading an older file lacks some, which torch
        # fills in); settings on both sides that the other lacks mean another optimizer.
        if extra and lacking:
            raise CheckpointError(
                f"{source}: {name!r} was saved by another kind of optimizer than this "
                f"{type(optimizer).__name__}: its group {index} has {extra} and lacks {lacking}. "
                "Build the optimizer the run was saved with (same class and settings)"
            )
    if not isinstance(optimizer, _ELEMENTWISE) or not isinstance(state.get("state"), Mapping):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wrong = []
    for key, values in state["state"].items():
        if not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(values, Mapping):
            continue
        shape = params[key].shape
        for field, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
                wrong.append(f"parameter {key} {field} {tuple(value.shape)} vs {tuple(shape)}")
    if wrong:
        shown = ", ".join(wrong[:_MAX_LISTED]) + (f" and {len(wrong) - _MAX_LISTED} more"
                                                  if len(wrong) > _MAX_LISTED else "")
        raise CheckpointError(
            f"{source}: {name!r} holds optimizer state for parameters of other shapes (file vs "
            f"optimizer: {shown}). Build the same model and optimizer the run was saved with"
        )
