"""Copies of lockstep's DDP: pickling and deepcopy, and state dicts without ``module.``.

:class:`PersistentDDP` is a base of :class:`~lockstep.ddp.DistributedDataParallel`. A pickled
or deep-copied DDP leaves out what is tied to the process group (the reducer, hooks, the
profiler) and rebuilds it on load; state dicts are the inner module's, so a checkpoint loads
into a plain model, and torch DDP's ``module.`` keys load too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.wrappers import called_by_holder

__all__ = ["PersistentDDP"]

_PREFIX = "module."


class PersistentDDP(nn.Module):
    """Pickling and state dicts of lockstep's DDP (see the module docstring); not used on its own."""

    # Set by DistributedDataParallel.
    module: nn.Module
    process_group: dist.ProcessGroup
    _reducer: Any

    # What a copy leaves out: the group and everything tied to it (DistributedDataParallel's).
    _unpicklable: tuple[str, ...] = ()

    def _reattach(self) -> None:
        """Rebuild what a copy left out, on the default group (DistributedDataParallel's)."""
        raise NotImplementedError

    # ---- pickling and deepcopy: without the process group, rebuilt on load ---------------
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                "DistributedDataParallel can be pickled or deep-copied only when it averages "
                "over the default process group (no process_group= or device_mesh= given); "
                "copy the inner model instead: copy.deepcopy(ddp.module)."
            )
        state = dict(self.__dict__)
        for key in self._unpicklable:
            state.pop(key, None)
        # A copy starts with the default reduction (the hook's state may hold a group).
        state["_hook_registered"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not dist.is_initialized():
            raise RuntimeError(
                "unpickling a DistributedDataParallel needs a process group: call "
                "lockstep.init_distributed() first, or unpickle the inner model."
            )
        self._reattach()

    # ---- checkpoints: keys without "module." ----------------------------------------------
    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The inner module's state dict: keys without torch DDP's ``module.``.

        ``state_dict(prefix="module.")`` gives torch DDP's keys instead (for a checkpoint that
        torch's DDP ``load_state_dict`` must read).

        Called by a module that holds this one (a container, ``torch.compile``'s wrapper,
        ``AveragedModel``: they pass their ``destination`` and a prefix), or with torch's old
        positional arguments, it gives torch's keys (``module.`` included): the holder's
        ``load_state_dict`` walks the submodules, ``module`` among them, and could not load
        its own state dict back without it (until 2026-11-29).
        """
        if called_by_holder(args, destination, prefix):
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load keys with or without torch DDP's ``module.`` prefix.

        Raises:
            ValueError: ``assign=True`` with several ranks (it would replace the parameters
                whose gradients are being averaged).
        """
        if assign and self._reducer is not None:
            raise ValueError(
                "DistributedDataParallel.load_state_dict(assign=True) would replace the "
                "parameters lockstep averages; load with assign=False (the default), or load "
                "into the module before wrapping it."
            )
        if state_dict and all(k.startswith(_PREFIX) for k in state_dict) \
                and not set(state_dict) <= set(self.module.state_dict()):
            # torch DDP's keys; unless they are the module's own (its child named `module`)
            state_dict = {k[len(_PREFIX):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
