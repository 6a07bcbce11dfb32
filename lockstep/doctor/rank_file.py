"""Where a rank's profile goes: ``rank<R>.json``, written atomically at exit or at the step budget.

``lockstep doctor`` runs a script for a bounded number of steps: when the recorder has closed
``max_steps`` steps it writes the file and ends the process with exit status 0 on every rank
(:meth:`RankFile.end_bounded_run`). That ``SystemExit`` is raised from inside the optimizer's
post-step hook, the one place every training loop passes through once per step; it unwinds the
user's loop like a ``sys.exit(0)`` would there, so ``finally`` blocks and atexit handlers run.
"""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RankFile"]


class RankFile:
    """``out_dir/rank<R>.json``: written once per new step count, and at interpreter exit.

    Args:
        out_dir: the directory (created when first written).
        rank: this rank.
        payload: returns what the file holds (``Recorder.payload``).
        step_count: returns the number of closed steps (a file is rewritten only after new ones).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int, payload: Callable[[], dict[str, Any]],
                 step_count: Callable[[], int]) -> None:
        self.path = Path(out_dir) / f"rank{rank}.json"
        self._payload, self._step_count = payload, step_count
        self._saved_at = -1
        atexit.register(self.save)

    def save(self) -> Path | None:
        """Write the file (atomically: a temporary file renamed) unless it holds this step count."""
        steps = self._step_count()
        if self._saved_at == steps:
            return None
        self._saved_at = steps
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Named by process: workers that never met a process group are each rank 0 and write
        # the same file; a shared temporary name made one's rename fail (the doctor then
        # reported a failed run instead of naming the missing group).
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._payload()))
        tmp.replace(self.path)
        return self.path

    def end_bounded_run(self) -> None:
        """The step budget is spent: write the file and end this process with status 0."""
        self.save()
        raise SystemExit(0)

    def close(self) -> None:
        """Write a last time and stop writing at exit."""
        self.save()
        atexit.unregister(self.save)
