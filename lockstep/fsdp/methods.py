"""torch's ``FSDPModule`` method names on a module given to :func:`lockstep.fully_shard`.

Torch turns a sharded module's class into ``FSDP<Class>``, whose methods scripts call:
``model.set_requires_gradient_sync(False)`` for accumulation, ``model.unshard()`` before a
forward. lockstep leaves the class alone (see docs/fsdp.md, "Differences"), so those scripts
would fail with an ``AttributeError``. Instead each sharded module gets, as attributes of its
own, the methods that have a lockstep counterpart, bound to it: the same call runs under both.
A name the module's class already defines is left to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

__all__ = ["attach_torch_methods"]


def attach_torch_methods(module: nn.Module, functions: dict[str, Callable[..., object]]) -> None:
    """Set ``module.<name>`` to ``functions[name]`` bound to ``module``, for each name the
    module (its class, or itself) does not define already."""
    for name, function in functions.items():
        if hasattr(type(module), name) or name in vars(module):
            continue
        bound = functools.partial(function, module)
        functools.update_wrapper(bound, function)  # help() and the name show torch's method
        setattr(module, name, bound)
