"""Part ``checkpoint``: how long ``Checkpointer.save()`` stalls training, model on the device.

Written against the public API only: ``save()`` is timed (the stall), then ``wait()`` if the
Checkpointer has one (an asynchronous save, issue 24), so the part runs before and after that
lands. The copy a save needs to leave the GPU is what pinned host memory speeds up.
"""

from __future__ import annotations

import tempfile
import time

import torch

import lockstep
from gpu_parts.common import Config, Section, batch_of, device_sync, lm_loss, median, transformer

__all__ = ["run"]


def worker(rank: int, cfg: Config) -> dict:
    lockstep.init_distributed(device=cfg.device)
    model = transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch_of(cfg, 0)
    lm_loss(model(x), y).backward()
    opt.step()  # Adam state exists: what a real checkpoint holds
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    stalls, totals = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = lockstep.Checkpointer(tmp, keep=1)
        for step in range(1, 1 + max(2, cfg.rounds // 2)):
            device_sync(cfg.device)
            start = time.perf_counter()
            ckpt.save(step, model=model, optimizer=opt)
            stall = time.perf_counter() - start
            wait = getattr(ckpt, "wait", None)
            if callable(wait):
                wait()
            totals.append(time.perf_counter() - start)
            stalls.append(stall)
    return {"bytes": nbytes, "stall_s": stalls, "total_s": totals,
            "asynchronous": callable(getattr(lockstep.Checkpointer, "wait", None))}


def run(cfg: Config) -> Section:
    section = Section("checkpoint", "Checkpoint stall: Checkpointer.save() with the model on the device")
    out = lockstep.spawn(worker, 1, args=(cfg,), timeout=540)[0]
    stall, total = median(out["stall_s"]), median(out["total_s"])
    mib = out["bytes"] / 2**20
    section.table(["state MiB", "save() stall s", "until written s", "stall / written", "save is asynchronous"],
                  [[f"{mib:.0f}", stall, total, stall / total if total else float("nan"),
                    "yes (wait() found)" if out["asynchronous"] else "no (blocking save)"]])
    section.data.update(out)
    return section
