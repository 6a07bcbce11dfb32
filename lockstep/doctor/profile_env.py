"""Profiling switched on from the environment, so a user's script needs no change.

``lockstep doctor`` launches the script with these variables set; every
:class:`lockstep.DistributedDataParallel` built in a worker reads them.

- ``LOCKSTEP_PROFILE``: folder where each rank writes ``rank<R>.json`` (profiling is on when set).
- ``LOCKSTEP_PROFILE_STEPS``: end the process after this many steps (a bounded run).
- ``LOCKSTEP_PROFILE_WARMUP``: first steps left out of summaries (default 5).
- ``LOCKSTEP_PROFILE_EVERY``: steps between cross-rank summaries logged on rank 0 (default 0).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lockstep.env import env_int

__all__ = [
    "EVERY_ENV",
    "PROFILE_ENV",
    "STEPS_ENV",
    "WARMUP_ENV",
    "profiling_requested",
    "settings_from_env",
]

PROFILE_ENV = "LOCKSTEP_PROFILE"
STEPS_ENV = "LOCKSTEP_PROFILE_STEPS"
WARMUP_ENV = "LOCKSTEP_PROFILE_WARMUP"
EVERY_ENV = "LOCKSTEP_PROFILE_EVERY"


def profiling_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for profiling (``LOCKSTEP_PROFILE`` is set)."""
    return bool((os.environ if environ is None else environ).get(PROFILE_ENV))


def _int(environ: Mapping[str, str], name: str, default: int | None, least: int) -> int | None:
    return env_int(environ, name, default, least, example=40)


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Keyword arguments for ``enable_profiling`` from the environment, or None when off.

    Raises:
        ValueError: a variable that is not a valid number (the message names it).
    """
    environ = os.environ if environ is None else environ
    if not profiling_requested(environ):
        return None
    return {
        "out_dir": environ[PROFILE_ENV],
        "max_steps": _int(environ, STEPS_ENV, None, 1),
        "warmup": _int(environ, WARMUP_ENV, 5, 0),
        "gather_every": _int(environ, EVERY_ENV, 0, 0),
    }
