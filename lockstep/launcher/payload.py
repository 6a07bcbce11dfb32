"""How ``lockstep.spawn`` ships a worker function and its arguments to new interpreters.

A spawned worker is a fresh interpreter: plain pickle names a function by module and name,
and the worker imports it. That fails for a function defined in an interactive ``__main__``
(a notebook cell, the REPL, ``python -c``): the worker's ``__main__`` has no such name
("Can't get attribute 'work' on <module '__main__'>"). Such functions are shipped by value
instead: their compiled code (``marshal``; parent and workers run the same Python), defaults,
closure and the globals they use, modules by name. Functions they call from the same session
come along the same way. Classes defined in an interactive session cannot be rebuilt that
way, so they are refused up front with what to do.

Packing happens in the caller, unpacking inside the worker's error handling, so a payload
that cannot be read comes back as the worker's error with its traceback.
"""

from __future__ import annotations

import io
import marshal
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["interactive_main", "pack", "unpack"]

_MAIN = "__main__"


def interactive_main() -> bool:
    """True when ``__main__`` is an interactive session (no file a worker could import)."""
    return not getattr(sys.modules.get(_MAIN), "__file__", None)


def _names(code: types.CodeType) -> Iterator[str]:
    """Global names ``code`` and the functions nested in it may read."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _rebuild_function(
    code: bytes,
    name: str,
    qualname: str,
    defaults: tuple | None,
    kwdefaults: dict | None,
    closure: tuple | None,
    captured: dict[str, Any],
) -> types.FunctionType:
    """Worker side: recreate a function shipped by value, in this worker's ``__main__``."""
    namespace = sys.modules[_MAIN].__dict__
    for key, value in captured.items():
        namespace.setdefault(key, value)
    cells = None if closure is None else tuple(types.CellType(value) for value in closure)
    fn = types.FunctionType(marshal.loads(code), namespace, name, defaults, cells)
    fn.__kwdefaults__ = kwdefaults
    fn.__qualname__ = qualname
    if qualname == name:
        namespace.setdefault(name, fn)  # so that functions shipped with it can call it
    return fn


def _import(name: str) -> types.ModuleType:
    __import__(name)
    return sys.modules[name]


class _Pickler(pickle.Pickler):
    """Pickle that sends an interactive session's functions by value."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shipped: set[int] = set()  # functions sent by value in this payload

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            return _import, (obj.__name__,)
        if getattr(obj, "__module__", None) != _MAIN or not interactive_main():
            return NotImplemented
        if isinstance(obj, types.FunctionType):
            return self._by_value(obj)
        if isinstance(obj, type):
            raise pickle.PicklingError(
                f"class {obj.__qualname__!r} is defined in this interactive session, which a "
                "spawned worker cannot import: define it in a module file (e.g. mymodel.py) "
                "and import it from there"
            )
        return NotImplemented

    def _by_value(self, fn: types.FunctionType) -> tuple:
        self._shipped.add(id(fn))
        captured = {}
        for name in dict.fromkeys(_names(fn.__code__)):
            if name not in fn.__globals__:
                continue  # a builtin, or an attribute name
            value = fn.__globals__[name]
            if id(value) in self._shipped:
                continue  # recursion: the worker finds it by name once it is rebuilt
            captured[name] = value
        closure = None
        if fn.__closure__ is not None:
            closure = tuple(cell.cell_contents for cell in fn.__closure__)
        code = marshal.dumps(fn.__code__)
        return _rebuild_function, (
            code, fn.__name__, fn.__qualname__, fn.__defaults__, fn.__kwdefaults__, closure,
            captured,
        )


def pack(fn: Any, args: tuple) -> bytes:
    """Serialise ``(fn, args)`` for a spawned worker.

    Raises:
        TypeError: something in it cannot reach a worker, named with what to do.
    """
    buffer = io.BytesIO()
    try:
        _Pickler(buffer).dump((fn, args))
        return buffer.getvalue()
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        what = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"lockstep.spawn cannot send {what} and its arguments to the workers: {exc}. "
            "Workers are new interpreters: pass a function defined at the top level of a module "
            "(or of a notebook cell) and arguments that can be pickled."
        ) from exc


def unpack(payload: bytes) -> tuple[Any, tuple]:
    """Worker side: the ``(fn, args)`` that :func:`pack` serialised."""
    try:
        fn, args = pickle.loads(payload)
    except AttributeError as exc:
        raise AttributeError(
            f"{exc}. A spawned worker imports the function by name: define it at the top level "
            'of its module, not under `if __name__ == "__main__":` nor inside another function'
        ) from exc
    return fn, tuple(args)
