"""Ordering a bucket's all-reduce after every stream that wrote into it (CUDA and other accelerators).

A gradient's post-accumulate hook runs on the stream its ``AccumulateGrad`` ran on, and the copy
into the bucket (or, in view mode, the accumulation itself) is queued there. NCCL orders its
all-reduce after the stream current at launch only, which is the stream of the *last* gradient
of the bucket. When gradients of one bucket are made on different streams (branches run on
streams of their own in forward), the all-reduce could read a slot before its copy has run.
torch's reducer leaves this open (the TODO in ``Reducer::all_reduce_bucket``); lockstep makes
the launching stream wait on each other stream that wrote into the bucket. On CPU there are no
streams and every function here is a no-op. See docs/ddp.md, "How lockstep orders CUDA streams".
"""

from __future__ import annotations

import torch

__all__ = ["current_stream", "note_stream", "wait_for_writers"]


def current_stream(device: torch.device) -> torch.Stream | None:
    """``device``'s current stream; None where there are no streams (CPU, meta)."""
    if device.type in ("cpu", "meta"):
        return None
    # torch.get_device_module (torch >= 2.3) rather than torch.accelerator (2.6): lockstep
    # supports torch 2.4. A backend without streams (no current_stream) has nothing to order.
    get = getattr(torch.get_device_module(device.type), "current_stream", None)
    return None if get is None else get(device)


def note_stream(writers: list[torch.Stream], device: torch.device) -> None:
    """Remember the current stream of ``device`` as one that wrote into a bucket."""
    stream = current_stream(device)
    if stream is not None and stream not in writers:
        writers.append(stream)


def wait_for_writers(writers: list[torch.Stream], device: torch.device) -> None:
    """Make the current stream wait on every other stream in ``writers`` (before a launch)."""
    if not writers:
        return
    launching = current_stream(device)
    if launching is None:
        return
    for stream in writers:
        if stream != launching:
            launching.wait_stream(stream)
