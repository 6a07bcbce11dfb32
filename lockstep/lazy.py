"""Lazy attribute access for packages: ``pkg.Name`` and ``pkg.submodule`` imported on first use.

``import lockstep`` (and ``import lockstep.launcher`` in every worker) stays cheap: nothing heavy
is imported until a name is used. Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the module that defines it.
        namespace: the package's ``globals()``; a name, once imported, is cached there.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__
