"""The user's model inside the wrappers put around it (DDP, DataParallel, ``torch.compile``)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["called_by_holder", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP/DataParallel (torch's or lockstep's) or ``torch.compile``."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(model).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
        ):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def called_by_holder(args: tuple[Any, ...], destination: Any, prefix: str) -> bool:
    """Whether a wrapper's ``state_dict`` call wants torch's keys, ``module.`` included.

    DDP and DataParallel give the inner module's keys when called on their own, but a module
    holding one (a container, ``torch.compile``'s wrapper, ``AveragedModel``) passes its
    ``destination`` and a prefix, and torch's old positional arguments carry both: those calls
    get torch's keys, since the holder's ``load_state_dict`` walks the submodules, ``module``
    among them, and could not load its own state dict back without it.
    """
    return bool(args) or (destination is not None and bool(prefix))
