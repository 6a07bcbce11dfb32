"""The user's model inside the wrappers put around it (DDP, DataParallel, ``torch.compile``)."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap_model"]


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
