"""Part ``streams``: gradients made on other CUDA streams, compared bitwise with torch's DDP.

Each case trains lockstep's DDP and torch's DDP side by side from the same weights on the same
batches, with the streams arranged the same way, and compares every parameter bitwise. A busy
side stream (a large matmul queued before backward) widens any window in which a copy could read
a gradient before the kernel that writes it has run. On CPU (dry run) streams do not exist: the
cases run on the default path and test the plumbing only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from gpu_parts.common import (
    Config,
    Section,
    batch_of,
    deterministic,
    lm_loss,
    params_equal,
    side_stream,
    spawn_shared,
    transformer,
)

__all__ = ["CASES", "run"]


def _busy(device: str) -> None:
    """Queue a long kernel on the current stream (a no-op on CPU)."""
    if device.startswith("cuda"):
        a = torch.randn(4096, 4096, device=device)
        for _ in range(8):
            a = a @ a
            a = a / a.norm()


def _plain(model, x, y, cfg) -> None:
    with side_stream(cfg.device):  # forward and backward both on a non-default stream
        _busy(cfg.device)
        lm_loss(model(x), y).backward()


def _switch(model, x, y, cfg) -> None:
    with side_stream(cfg.device):  # forward on one stream...
        loss = lm_loss(model(x), y)
    with side_stream(cfg.device):  # ...backward called from another, busy one
        _busy(cfg.device)
        loss.backward()


def _step_fn(case: str) -> Callable:
    return {"side_stream": _plain, "stream_switch": _switch, "bucket_view": _plain,
            "no_sync": _plain}[case]


CASES = ["side_stream", "stream_switch", "bucket_view", "no_sync"]


def _train(model, ddp, cfg: Config, case: str, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fn = _step_fn(case)
    for step in range(cfg.check_steps):
        opt.zero_grad(set_to_none=(step % 2 == 0))  # both .grad paths: fresh tensor and reused
        if case == "no_sync":
            with ddp.no_sync():
                x, y = batch_of(cfg, 100 + step, rank)
                fn(ddp, x, y, cfg)
        x, y = batch_of(cfg, step, rank)
        fn(ddp, x, y, cfg)
        if cfg.cuda:  # the optimizer reads .grad on the default stream, as a user's loop does
            torch.cuda.synchronize(cfg.device)
        opt.step()


def worker(rank: int, cfg: Config, backend: str) -> dict:
    deterministic(cfg)
    lockstep.init_distributed(backend=backend, device=cfg.device)
    out = {}
    for case in CASES:
        for as_view in ([False, True] if case == "bucket_view" else [False]):
            ours_m, theirs_m = transformer(cfg), transformer(cfg)
            ours = lockstep.DistributedDataParallel(ours_m, gradient_as_bucket_view=as_view)
            theirs = TorchDDP(theirs_m, gradient_as_bucket_view=as_view)
            _train(ours_m, ours, cfg, case, rank)
            _train(theirs_m, theirs, cfg, case, rank)
            ok, where = params_equal(ours_m, theirs_m)
            out[f"{case}{' (view)' if as_view else ''}"] = {"equal": ok, "where": where}
    dist.barrier()
    return out


def run(cfg: Config) -> Section:
    section = Section("streams", "CUDA stream safety: lockstep DDP vs torch DDP, bitwise")
    if not cfg.cuda:
        section.notes.append("dry run: CPU has no streams; the cases ran on the default path (plumbing only)")
    section.notes.append("a bucket written on two streams (where torch's own order races) is compared with "
                         "one stream, not with torch: tests/test_ddp_streams.py, run by the `tests` part")
    results = spawn_shared(worker, cfg, section)
    rows = []
    for case in results[0]:
        cells = [section.check(r[case]["equal"], f"streams/{case} rank {k}: differs at {r[case]['where']}")
                 for k, r in enumerate(results)]
        rows.append([case, cfg.check_steps, *cells, results[0][case]["where"] or "-"])
    section.table(["case", "steps", "rank 0 bitwise equal", "rank 1 bitwise equal", "first difference"], rows)
    section.data["cases"] = results
    return section
