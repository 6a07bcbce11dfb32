"""The public entry points: ``lockstep.profile(model)`` and :func:`gather_report`."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from lockstep.doctor.profile_file import build_profile
from lockstep.doctor.recorder import Recorder

__all__ = ["profile", "gather_report"]


def gather_report(recorder: Recorder) -> dict[str, Any]:
    """Every rank's record gathered (one collective: call it on every rank) into a profile.

    Returns:
        The ``profile.json`` object (docs/profile-format.md) with the doctor's ``attribution``.
    """
    payload = recorder.payload()
    if recorder.group is None or recorder.world_size == 1:
        return build_profile([payload])
    payloads: list[Any] = [None] * recorder.world_size
    dist.all_gather_object(payloads, payload, group=recorder.group)
    return build_profile(payloads)


@contextlib.contextmanager
def profile(model: Any, out_dir: str | os.PathLike | None = None, warmup: int = 5,
            gather_every: int = 0) -> Iterator[Recorder]:
    """Profile ``model`` (a :class:`lockstep.DistributedDataParallel`) inside the block.

    On leaving, every rank takes part in one gather and rank 0 writes ``profile.json`` into
    ``out_dir`` (when given); profiling is switched off again.

    Example::

        with lockstep.profile(model, out_dir="prof") as prof:
            for x, y in loader: ...
        # prof/profile.json: phases, buckets, per-rank means, the straggler
    """
    if not hasattr(model, "enable_profiling"):
        raise TypeError(
            f"lockstep.profile needs a lockstep.DistributedDataParallel, got "
            f"{type(model).__name__}; wrap the model first (it works at world 1 too)"
        )
    recorder = model.enable_profiling(warmup=warmup, gather_every=gather_every)
    try:
        yield recorder
    finally:
        report = gather_report(recorder) if recorder.step_count else None
        model.enable_profiling(False)
        if out_dir is not None and report is not None and recorder.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "profile.json").write_text(json.dumps(report, indent=1))
