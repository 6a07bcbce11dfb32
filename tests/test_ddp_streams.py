"""How lockstep's DDP orders CUDA streams (lockstep/ddp/streams.py; docs/ddp.md).

Tiers: the stream helpers on CPU (no streams: no-ops, nothing recorded); GPU variants that
would catch each ordering mistake the review in docs/ddp.md names, each bitwise against a
reference: torch's DDP where torch orders streams correctly, and lockstep on the default stream
where torch itself does not (a bucket written on two streams).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.ddp.streams import current_stream, note_stream, wait_for_writers

STEPS = 4


# ---- CPU: the helpers are no-ops -----------------------------------------------------------
def test_cpu_has_no_streams_to_order() -> None:
    cpu = torch.device("cpu")
    writers: list = []
    note_stream(writers, cpu)
    wait_for_writers(writers, cpu)
    assert current_stream(cpu) is None and writers == []


# ---- GPU bodies (module level: spawned workers import them) --------------------------------
def _world(rank: int) -> torch.device:
    """Two ranks: a GPU each with NCCL when there are two, else both on cuda:0 over gloo."""
    # cuBLAS is reproducible across streams only with a fixed workspace (read at first use).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.cuda.device_count() >= 2:
        lockstep.init_distributed(backend="nccl", device=f"cuda:{rank}")
        return torch.device("cuda", rank)
    lockstep.init_distributed(backend="gloo", device="cuda:0")  # NCCL refuses two ranks on one GPU
    return torch.device("cuda", 0)


def _busy(device: torch.device) -> None:
    """Queue ~tens of ms of work on the current stream: a late writer, if nothing waits for it."""
    a = torch.randn(2048, 2048, device=device)
    for _ in range(20):
        a = (a @ a) / 2048


class SlowGrad(torch.autograd.Function):
    """Identity whose backward first keeps its stream busy."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _busy(grad.device)
        return grad


class TwoStreams(nn.Module):
    """Two branches whose forward (so backward, and the gradients) run on streams of their own;
    all four parameters share one bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.use_streams = True

    def forward(self, x):
        if not self.use_streams:
            return self.a(x) + SlowGrad.apply(self.b(x))
        main = torch.cuda.current_stream(x.device)
        s1, s2 = torch.cuda.Stream(x.device), torch.cuda.Stream(x.device)
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            ya = self.a(x)
        with torch.cuda.stream(s2):
            # b's backward is slowed and, made later in forward, runs first in backward: its
            # hooks fire first, a's last, so the all-reduce launches from a's stream (s1).
            yb = SlowGrad.apply(self.b(x))
        main.wait_stream(s1)
        main.wait_stream(s2)
        return ya + yb


def _train(model: nn.Module, ddp: nn.Module, device: torch.device, rank: int, streams: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(32, 64, generator=gen).to(device)
        opt.zero_grad(set_to_none=step % 2 == 0)
        if streams == "side":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                _busy(device)
                ddp(x).square().mean().backward()
            torch.cuda.current_stream(device).wait_stream(side)
        elif streams == "switch":
            loss = ddp(x).square().mean()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                _busy(device)
                loss.backward()
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            ddp(x).square().mean().backward()
        opt.step()


def _two_stream_bucket(rank: int) -> list[bool]:
    device = _world(rank)
    out = []
    for as_view in (False, True):
        models = []
        for use_streams in (True, False):
            torch.manual_seed(0)
            model = TwoStreams().to(device)
            model.use_streams = use_streams
            ddp = lockstep.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
            _train(model, ddp, device, rank, "none")
            models.append(model)
        out.append(all(torch.equal(p, q) for p, q in zip(*(m.parameters() for m in models))))
    dist.barrier()
    return out


def _against_torch(rank: int) -> dict[str, bool]:
    device = _world(rank)
    out = {}
    for streams in ("side", "switch"):
        for as_view in (False, True):
            trained = []
            for wrap in (lockstep.DistributedDataParallel, TorchDDP):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(device)
                _train(model, wrap(model, gradient_as_bucket_view=as_view), device, rank, streams)
                trained.append(model)
            out[f"{streams} view={as_view}"] = all(
                torch.equal(p, q) for p, q in zip(trained[0].parameters(), trained[1].parameters()))
    dist.barrier()
    return out


@pytest.mark.gpu
def test_gpu_bucket_written_on_two_streams_waits_for_both() -> None:
    """Fails without wait_for_writers: the all-reduce, ordered after the last writer's stream
    only, reads the slow branch's slots before their copy (or accumulation) has run."""
    for result in lockstep.spawn(_two_stream_bucket, 2, timeout=180):
        assert result == [True, True], result


@pytest.mark.gpu
def test_gpu_side_stream_and_stream_switch_match_torch_ddp_bitwise() -> None:
    for result in lockstep.spawn(_against_torch, 2, timeout=180):
        assert all(result.values()), result


@pytest.mark.gpu
def test_gpu_no_sync_on_a_side_stream_matches_torch_ddp_bitwise() -> None:
    for result in lockstep.spawn(_no_sync, 2, timeout=180):
        assert all(result), result


def _no_sync(rank: int) -> list[bool]:
    device = _world(rank)
    out = []
    for as_view in (False, True):
        trained = []
        for wrap in (lockstep.DistributedDataParallel, TorchDDP):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(device)
            ddp = wrap(model, gradient_as_bucket_view=as_view)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(STEPS):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    with ddp.no_sync():
                        F.mse_loss(ddp(torch.randn(8, 64, generator=gen).to(device)),
                                   torch.zeros(8, 64, device=device)).backward()
                    _busy(device)
                    F.mse_loss(ddp(torch.randn(8, 64, generator=gen).to(device)),
                               torch.zeros(8, 64, device=device)).backward()
                torch.cuda.current_stream(device).wait_stream(side)
                opt.step()
                opt.zero_grad()
            trained.append(model)
        out.append(all(torch.equal(p, q) for p, q in zip(trained[0].parameters(), trained[1].parameters())))
    dist.barrier()
    return out
