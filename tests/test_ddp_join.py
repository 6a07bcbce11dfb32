"""Uneven inputs: ddp.join() against a one-process reference that averages the active shards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep

BATCHES = [3, 1, 2]  # per rank: rank 1 runs out first, rank 0 runs longest


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _train_uneven(divide_by_initial: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    reference = copy.deepcopy(model)
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(BATCHES[rank]):
            opt.zero_grad()
            x, y = _data(step, rank)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    # Reference: each step averages the shards of the ranks that still have data.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(max(BATCHES)):
        active = [r for r in range(world) if step < BATCHES[r]]
        divisor = world if divide_by_initial else len(active)
        ref_opt.zero_grad()
        (sum(F.mse_loss(reference(_data(step, r)[0]), _data(step, r)[1]) for r in active)
         / divisor).backward()
        ref_opt.step()
    return max((a - b).abs().max().item()
               for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def _uneven_worlds(rank: int) -> dict:
    lockstep.init_distributed()
    return {"initial": _train_uneven(True), "active": _train_uneven(False)}


def test_join_matches_reference_at_world3():
    for result in lockstep.spawn(_uneven_worlds, 3, timeout=120):
        assert result["initial"] < 1e-5 and result["active"] < 1e-5, result


def _early_termination(rank: int) -> None:
    lockstep.init_distributed()
    ddp = lockstep.DistributedDataParallel(_model())
    with ddp.join(throw_on_early_termination=True):
        for step in range(BATCHES[rank]):
            x, y = _data(step, rank)
            F.mse_loss(ddp(x), y).backward()


def test_throw_on_early_termination_raises_instead_of_hanging():
    with pytest.raises(lockstep.WorkerError, match="ran out"):
        lockstep.spawn(_early_termination, 3, timeout=60)


def _buffers_from_an_active_rank(rank: int) -> int:
    lockstep.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    ddp = lockstep.DistributedDataParallel(model)
    with ddp.join():
        for step in range([1, 3][rank]):  # rank 0, the usual buffer source, stops first
            ddp(_data(step, rank)[0]).sum().backward()
    return int(model[1].num_batches_tracked)


def test_buffers_come_from_an_active_rank_once_rank0_joined():
    # Every forward of rank 1 must count: rank 0's frozen statistics must not overwrite them.
    assert lockstep.spawn(_buffers_from_an_active_rank, 2, timeout=60) == [3, 3]
