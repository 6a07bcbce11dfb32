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
