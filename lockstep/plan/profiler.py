"""A minimal one-process profile for the planner, in the doctor's ``profile.json`` format.

Stand-in until ``lockstep doctor`` writes profiles: it times forward, backward and the optimizer
step of a model on one device, records when each parameter's gradient is accumulated, and groups
parameters into DDP's buckets (1 MB first, then ``bucket_cap_mb``) in the order their gradients
arrived -- the order lockstep's reducer rebuilds its buckets in after the first iteration. A
bucket is ready when its last gradient is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.ddp.bucket import MB, BucketSpec, assign_buckets

__all__ = ["profile_model"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                  optimizer: torch.optim.Optimizer, *, steps: int = 10, warmup: int = 3,
                  bucket_cap_mb: float = 25, batch_size: int | None = None) -> dict:
    """Time ``steps`` steps of ``model`` on ``batch = (inputs, targets)``; return a profile dict.

    Args:
        loss_fn: ``loss_fn(model(inputs), targets)``.
        batch_size: samples per step, recorded as ``batch_size_per_rank``.

    Returns:
        A ``lockstep-profile`` version 1 document (docs/profile-format.md) at world size 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters to profile")
    device = named[0][1].device
    inputs, targets = batch
    ready_at: dict[int, float] = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda _p, i=i: ready_at.__setitem__(i, time.perf_counter())) for i, (_, p) in enumerate(named)]
    rows: list[dict[str, float]] = []
    try:
        for step in range(warmup + steps):
            ready_at.clear()
            _sync(device)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            optimizer.step()
            _sync(device)
            t3 = time.perf_counter()
            if step >= warmup:
                rows.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                             "step": t3 - t0, **{f"p{i}": t - t1 for i, t in ready_at.items()}})
    finally:
        for h in handles:
            h.remove()
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    arrival = sorted(range(len(named)), key=lambda i: med.get(f"p{i}", med["backward"]))
    specs = [BucketSpec.of(p) for _, p in named]
    buckets = []
    for index, members in enumerate(assign_buckets(specs, arrival, int(bucket_cap_mb * MB))):
        buckets.append({
            "index": index,
            "bytes": sum(specs[i].numel * specs[i].element_size for i in members),
            "params": [named[i][0] for i in members],
            "ready": max(med.get(f"p{i}", med["backward"]) for i in members),
        })
    grad_bytes = sum(p.numel() * p.element_size() for _, p in named)
    phases = {"data": 0.0, "forward": med["forward"], "backward": med["backward"],
              "exposed_comm": 0.0, "optimizer": med["optimizer"], "step": med["step"]}
    return {
        "format": "lockstep-profile", "version": 1, "world_size": 1, "backend": None,
        "device": device.type, "torch": torch.__version__, "mode": "bare",
        "batch_size_per_rank": batch_size, "steps": steps,
        "model": {"parameters": sum(p.numel() for p in model.parameters()),
                  "trainable_parameters": sum(p.numel() for _, p in named),
                  "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "grad_bytes": grad_bytes, "dtype": str(named[0][1].dtype).replace("torch.", "")},
        "phases": phases, "buckets": buckets,
        "per_rank": [{"rank": 0, "host": None, "phases": phases}],
        "source": "lockstep.plan.profiler (stand-in for lockstep doctor)",
    }
