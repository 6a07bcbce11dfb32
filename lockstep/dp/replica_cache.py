"""Keep inference replicas between forwards; copy the model again only when it changed.

Torch's DataParallel copies every parameter to every device at every forward, even under
``torch.no_grad()`` where nothing needs a fresh autograd graph. Here the replicas built without
autograd are kept, keyed by each parameter's and buffer's identity, storage and version counter
(bumped by every in-place update: optimizer steps, ``load_state_dict``, BatchNorm statistics)
and by each submodule's identity and train/eval flag, and rebuilt only when that key changes.

Plain attributes (a temperature, an ``eps``) set on or deleted from the module since are
brought to the replicas at every reuse.
A module holding inference tensors (made under ``torch.inference_mode()``, which keep no
version counter) is not cached. Limit: writes through ``tensor.data`` do not bump the version
counter; call :meth:`clear` after such a write (or build the wrapper with ``cache_replicas=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lockstep._torch_compat import tensor_version
from lockstep.dp.replicate import attribute_snapshots, module_pairs, refresh_attributes, replicate

__all__ = ["ReplicaCache", "cacheable", "state_key"]


def cacheable(module: nn.Module) -> bool:
    """Whether replicas of ``module`` may be kept: not for inference tensors (made under
    ``torch.inference_mode()``), which have no version counter to tell a change by."""
    return not any(t.is_inference() for t in [*module.parameters(), *module.buffers()])


def state_key(module: nn.Module) -> tuple[Any, ...]:
    """What has to be equal for a replica of ``module`` to still be a faithful copy."""
    # The version is the counter autograd itself uses to spot in-place writes.
    tensors = tuple(
        (id(t), t.data_ptr(), tensor_version(t)) for t in [*module.parameters(), *module.buffers()]
    )
    # Each submodule's identity with its flag: a child replaced by another (an activation
    # swapped for an ablation) changes the key even when neither holds tensors (until
    # 2026-11-29 a parameterless one was missed). The cache's pairs hold the old modules, so
    # their ids cannot be reused while the key is kept.
    return tensors, tuple((id(m), m.training) for m in module.modules())


class ReplicaCache:
    """Replicas of one module made without autograd, rebuilt when the module changes."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._replicas: list[nn.Module] = []
        self._pairs: list[tuple[nn.Module, nn.Module]] = []  # (original, copy), copies only
        self._seen: list[dict[str, Any]] = []  # each original's attributes when last looked at

    def get(self, module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
        """Replicas of ``module`` on ``devices`` (detached), reusing the last ones if still current."""
        key = (state_key(module), tuple(devices))
        if key != self._key:
            self.clear()  # drop the stale copies before making new ones: peak memory
            self._replicas = replicate(module, devices, detach=True)
            self._pairs = [pair for replica in self._replicas if replica is not module
                           for pair in module_pairs(module, replica)]
            self._seen = attribute_snapshots(self._pairs)
            self._key = key
        else:  # the same tensors: plain attributes set or deleted since (a temperature) follow
            refresh_attributes(self._pairs, self._seen)
        return self._replicas

    def clear(self) -> None:
        """Forget the replicas (and free their memory on the other devices)."""
        self._key = None
        self._replicas = []
        self._pairs = []
        self._seen = []
