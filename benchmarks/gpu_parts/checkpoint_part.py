"""Part ``checkpoint``: what a save costs the training loop, model and Adam state on the device.

Written against the public API only. Per round, on one GPU:

- ``step``: a training step with no save (forward, backward, AdamW step), device synchronised;
- ``save()``: how long :meth:`Checkpointer.save` holds the loop (asynchronous by default: the
  parameters' and optimizer state's copy is deferred to a side stream, issue 24);
- ``step after``: the training step right after the save (it waits for any copy still running
  before ``optimizer.step()`` may change the weights); its excess over ``step`` is part of the
  stall;
- ``until written``: from ``save()`` to the end of ``wait()``;
- the same with ``defer_copy=False`` (the whole snapshot taken inside ``save()``) and with
  ``blocking=True``; and ``torch.save`` of the same state dicts to the same disk (the reference
  a user compares with).

The claim: the loop's stall (``save()`` plus the next step's excess) stays below ``torch.save``'s.
Every deferred checkpoint is also compared, file by file, with a blocking one of the same state.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

import lockstep
from gpu_parts.common import Config, Section, batch_of, device_sync, lm_loss, median, transformer
from lockstep.checkpoint.io import read_verified

__all__ = ["run"]


def _files_equal(a: Path, b: Path) -> bool:
    """Every tensor file of two checkpoint directories holds equal tensors."""
    names = sorted(p.name for p in a.iterdir())
    if not names or names != sorted(p.name for p in b.iterdir()):
        return False
    return all(_same(read_verified(a / name), read_verified(b / name)) for name in names)


def _same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return bool(x == y) or (isinstance(x, float) and math.isnan(x) and isinstance(y, float) and math.isnan(y))


def worker(rank: int, cfg: Config) -> dict:
    lockstep.init_distributed(device=cfg.device)
    model = transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = iter(range(10**6))

    def step() -> float:
        device_sync(cfg.device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        x, y = batch_of(cfg, next(batch))
        lm_loss(model(x), y).backward()
        opt.step()
        device_sync(cfg.device)
        return time.perf_counter() - start

    for _ in range(3):
        step()  # warm up; Adam state exists: what a real checkpoint holds
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    rows: dict[str, dict[str, list[float]]] = {}
    equal = []
    rounds = max(2, cfg.rounds - 2)
    with tempfile.TemporaryDirectory() as tmp:
        modes = {"deferred (default)": {}, "defer_copy=False": {"defer_copy": False}}
        for mode, kwargs in modes.items():
            ckpt = lockstep.Checkpointer(Path(tmp) / mode.split()[0], keep=1, **kwargs)
            got = rows[mode] = {"step": [], "save": [], "step after": [], "written": []}
            start = time.perf_counter()
            ckpt.save(0, model=model, optimizer=opt)  # the first save allocates the pinned buffers
            got["first save"] = [time.perf_counter() - start]
            step()
            ckpt.wait()
            for r in range(rounds):
                got["step"].append(step())
                device_sync(cfg.device)
                start = time.perf_counter()
                ckpt.save(r + 1, model=model, optimizer=opt)
                got["save"].append(time.perf_counter() - start)
                got["step after"].append(step())
                ckpt.wait()
                got["written"].append(time.perf_counter() - start)
            if mode.startswith("deferred"):  # the deferred save equals a blocking one of that state
                ref = lockstep.Checkpointer(Path(tmp) / "reference", keep=1)
                ckpt.save(rounds + 1, model=model, optimizer=opt)
                ref.save(rounds + 1, model=model, optimizer=opt, blocking=True)
                step()
                ckpt.wait()
                name = f"step_{rounds + 1:012d}"
                equal.append(_files_equal(Path(tmp) / "deferred" / name, Path(tmp) / "reference" / name))
        blocking = lockstep.Checkpointer(Path(tmp) / "blocking", keep=1)
        rows["blocking=True"] = got = {"step": [], "save": [], "step after": [], "written": []}
        start = time.perf_counter()
        blocking.save(0, model=model, optimizer=opt, blocking=True)
        got["first save"] = [time.perf_counter() - start]
        torch_saves = []
        for r in range(rounds):
            got["step"].append(step())
            device_sync(cfg.device)
            start = time.perf_counter()
            blocking.save(r + 1, model=model, optimizer=opt, blocking=True)
            got["save"].append(time.perf_counter() - start)
            got["written"].append(got["save"][-1])
            got["step after"].append(step())
            device_sync(cfg.device)
            start = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(tmp) / "torch.pt")
            torch_saves.append(time.perf_counter() - start)
    return {"bytes": nbytes, "rows": rows, "torch_save_s": torch_saves, "equal": equal}


def run(cfg: Config) -> Section:
    section = Section("checkpoint", "Checkpoint stall: what Checkpointer.save() costs the loop, state on the device")
    out = lockstep.spawn(worker, 1, args=(cfg,), timeout=540)[0]
    torch_save = median(out["torch_save_s"])
    table = []
    for mode, got in out["rows"].items():
        step, save, after = median(got["step"]), median(got["save"]), median(got["step after"])
        stall = save + max(0.0, after - step)
        table.append([mode, median(got["first save"]), step, save, after, stall, median(got["written"]),
                      stall / torch_save])
    section.lines.append(f"State: {out['bytes'] / 2**20:.0f} MiB (parameters, buffers, AdamW state). "
                         f"`torch.save` of the same state dicts: **{torch_save:.3f} s** (median).")
    section.lines.append("")
    section.table(["save", "first save() s", "step s", "save() s", "step after s", "loop stall s", "until written s",
                   "stall / torch.save"], table)
    default_stall = table[0][5]
    section.notes.append("stall = save() + (step after - step); medians over the rounds after a first save "
                         "(its own column: it allocates the reused pinned host buffers)")
    if not cfg.dry_run:  # tiny CPU sizes measure fixed costs only
        section.check(default_stall < torch_save, f"default save stalls the loop less than torch.save "
                      f"({default_stall:.3f} s vs {torch_save:.3f} s)")
    section.check(bool(out["equal"]) and all(out["equal"]),
                  "a deferred-copy checkpoint equals a blocking one of the same state, tensor by tensor")
    section.data.update(out)
    return section
