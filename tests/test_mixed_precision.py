"""Autocast with DDP (and ZeRO, SyncBatchNorm): averaged, finite gradients; equal replicas.

CPU runs bf16 autocast at world 2; the CUDA variant runs fp16 autocast with a GradScaler.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep

STEPS = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return lockstep.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(),
            torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3),
        )
    )


def _batch(rank: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank)).to(device)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t)
    return all(torch.equal(c, t) for c in copies)


def _train(rank: int, device: torch.device, dtype: torch.dtype, optimizer: str) -> dict:
    """Train DDP under autocast; at each step compare its gradients with the mean of a plain
    replica's local gradients (same autocast, same data), all-reduced by hand."""
    world = dist.get_world_size()
    ddp = lockstep.DistributedDataParallel(_net().to(device))
    replica = _net().to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    params = list(ddp.parameters())
    if optimizer == "zero":
        opt = lockstep.ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-2)
    else:
        opt = torch.optim.Adam(params, lr=1e-2)
    out = {"grad_error": 0.0, "finite": True, "same_grads": True}
    for step in range(STEPS):
        x = _batch(rank, step, device)
        with torch.autocast(device.type, dtype=dtype):
            logits = ddp(x)
            loss = logits.square().mean()
            reference_loss = replica(x).square().mean()
        out["logits_dtype"] = logits.dtype
        scaler.scale(loss).backward()
        reference_loss.backward()
        grads = _flat(p.grad for p in params)
        expected = _flat(p.grad for p in replica.parameters())
        if scaler.is_enabled():
            grads = grads / scaler.get_scale()
        dist.all_reduce(expected)
        expected /= world
        out["grad_error"] = max(out["grad_error"], (grads - expected).abs().max().item())
        out["finite"] &= bool(torch.isfinite(grads).all())
        out["same_grads"] &= _same_on_all_ranks(grads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        replica.zero_grad()
        with torch.no_grad():  # keep the replica on the trained weights for the next step
            for p, q in zip(replica.parameters(), params):
                p.copy_(q)
    out["same_params"] = _same_on_all_ranks(_flat(params))
    out["same_running_stats"] = _same_on_all_ranks(_flat(ddp.module[1].buffers()))
    out["params"] = _flat(params).tolist()  # plain numbers: a tensor cannot outlive its worker
    return out


def _worker(rank: int, device_type: str, dtype: torch.dtype) -> dict:
    info = lockstep.init_distributed(device=f"cuda:{rank}" if device_type == "cuda" else "cpu")
    device = info.device
    return {name: _train(rank, device, dtype, name) for name in ("adam", "zero")}


def _check(results: list[dict], dtype: torch.dtype, tolerance: float) -> None:
    for per_rank in results:
        # ZeRO shards Adam's state, yet steps every parameter as Adam does.
        zero, adam = (torch.tensor(per_rank[k]["params"]) for k in ("zero", "adam"))
        assert torch.allclose(zero, adam, atol=1e-6)
        for name, out in per_rank.items():
            assert out["logits_dtype"] == dtype, "autocast did not run the model in low precision"
            assert out["finite"] and out["same_grads"], (name, out)
            assert out["same_params"] and out["same_running_stats"], (name, out)
            assert out["grad_error"] < tolerance, (name, out)


@pytest.mark.multirank
def test_bf16_autocast_with_ddp_and_zero_on_cpu():
    results = lockstep.spawn(_worker, 2, args=("cpu", torch.bfloat16), timeout=120)
    _check(results, torch.bfloat16, 1e-5)


@pytest.mark.gpu
@pytest.mark.multirank
def test_fp16_autocast_with_grad_scaler_on_cuda():
    world = min(2, torch.cuda.device_count())
    results = lockstep.spawn(_worker, world, args=("cuda", torch.float16), timeout=120)
    _check(results, torch.float16, 1e-3)
