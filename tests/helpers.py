"""Helpers shared by several test files (fixtures shared the same way live in conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["wait_for_files"]


def wait_for_files(paths: list[Path], limit_s: float = 90.0) -> None:
    """Wait until every path exists, at most ``limit_s`` (a rank that "hangs" on purpose until
    the others have given up; bounded so that a bug cannot hang pytest)."""
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)
