"""lockstep.fully_shard against torch's own ``torch.distributed.fsdp.fully_shard`` (FSDP2) on gloo/CPU.

The same transformer (per-block units, a tied embedding/head in the root, uneven shards), sharded
the same way by each, trained 3 AdamW steps on each rank's part of the batch: the unsharded
parameters agree to 1e-10 in float64 at worlds 2 and 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_fsdp import ADAMW, TOL, _batches, _loss, _mine, _model, _shard

import lockstep
from lockstep.fsdp import full_state_dict

torch_fsdp = pytest.importorskip("torch.distributed.fsdp")
dcp_state = pytest.importorskip("torch.distributed.checkpoint.state_dict")


def torch_worker(rank: int) -> float:
    lockstep.init_distributed()
    size = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size,))
    theirs = _model()
    for block in theirs.blocks:
        torch_fsdp.fully_shard(block, mesh=mesh)
    torch_fsdp.fully_shard(theirs, mesh=mesh)
    ours = _shard(_model())
    opts = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (theirs, ours)]
    for x, y in _batches(3):
        for model, opt in zip((theirs, ours), opts):
            opt.zero_grad()
            _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
            opt.step()
    options = dcp_state.StateDictOptions(full_state_dict=True)
    reference = dcp_state.get_model_state_dict(theirs, options=options)
    mine = full_state_dict(ours)
    assert set(reference) == set(mine)
    return max((reference[k] - mine[k]).abs().max().item() for k in mine)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_equals_torch_fully_shard(world):
    assert max(lockstep.spawn(torch_worker, world, timeout=120)) < TOL


def _scaler_skips_together(rank: int) -> list:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    lockstep.init_distributed()
    out = []
    for scaler_class in (torch.amp.GradScaler, ShardedGradScaler):
        model = torch.nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        lockstep.fully_shard(model)  # row 0 is rank 0's shard, row 1 rank 1's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = scaler_class("cpu", init_scale=2.0 ** 120)
        loss = (model(torch.ones(1, 4)) * torch.tensor([[1e4, 1.0]])).sum()  # inf in row 0 only
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), model.weight.detach().clone()))  # this rank's shard
    return out


def test_gradient_scaling_needs_the_sharded_scaler_as_torchs_fully_shard_does_not():
    # Only rank 0's shard overflows. A plain GradScaler decides per rank (a plain tensor's
    # check): rank 1 steps and keeps its scale, as docs/fsdp.md says; torch's ShardedGradScaler
    # agrees across ranks, with lockstep's shards too: both skip.
    (plain0, sharded0), (plain1, sharded1) = lockstep.spawn(_scaler_skips_together, 2, timeout=90)
    assert plain0[0] != plain1[0]  # the documented difference
    assert sharded0[0] == sharded1[0] == 2.0 ** 119
    assert torch.equal(sharded0[1], torch.ones(1, 4)) and torch.equal(sharded1[1], torch.ones(1, 4))


def test_torchs_sharded_state_dict_is_named_not_loaded():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from lockstep.fsdp import ModelState

    lockstep.init_distributed()
    try:
        theirs = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        torch_fully_shard(theirs)
        with pytest.raises(ValueError, match=r"are DTensors .*full_state_dict=True"):
            ModelState(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
                       ).load_state_dict(theirs.state_dict())
    finally:
        lockstep.shutdown_distributed()


class _Owns(torch.nn.Linear):
    def reshard(self) -> str:  # a method of the user's class keeps its meaning
        return "mine"


def _methods_worker(rank: int) -> tuple[float, str, str]:
    """One script, written for torch's FSDPModule methods, run with both fully_shards."""
    lockstep.init_distributed()
    size = dist.get_world_size()

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size,))
    policy, offload = torch_fsdp.MixedPrecisionPolicy(), torch_fsdp.OffloadPolicy()

    def run(shard) -> torch.nn.Module:
        model = _model()
        for block in model.blocks:  # torch's keywords, the same call for both
            shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
        shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        for x, y in _batches(2):
            model.set_requires_gradient_sync(False)  # accumulate two micro-batches
            for micro, (cx, cy) in enumerate(zip(x.chunk(2), y.chunk(2))):
                if micro == 1:
                    model.set_requires_gradient_sync(True)
                _loss(model, _mine(cx, rank, size), _mine(cy, rank, size)).backward()
            opt.step()
            opt.zero_grad()
        model.set_reshard_after_backward(True)
        model.set_reshard_after_forward(True, recurse=False)
        model.unshard(async_op=True).wait()
        model.reshard()
        return model

    theirs, ours = run(torch_fsdp.fully_shard), run(lockstep.fully_shard)
    reference = dcp_state.get_model_state_dict(theirs, options=dcp_state.StateDictOptions(full_state_dict=True))
    mine = full_state_dict(ours)
    own = lockstep.fully_shard(_Owns(4, 4))
    return max((reference[k] - mine[k]).abs().max().item() for k in mine), own.reshard(), ours.unshard.__name__


@pytest.mark.multirank
def test_torchs_method_names_run_on_a_sharded_module():
    """model.set_requires_gradient_sync(False), model.unshard()...: torch's FSDPModule methods,
    bound to each module lockstep shards, give torch's results; the class is unchanged."""
    for diff, own, name in lockstep.spawn(_methods_worker, 2, timeout=120):
        assert diff < TOL
        assert own == "mine" and name == "unshard"
