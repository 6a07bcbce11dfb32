"""Ranks that give ZeroRedundancyOptimizer or fully_shard different settings are told so.

Each case used to step each shard with its owner's settings silently (another ``lr`` or
optimizer class per rank), or to hang until the process group's timeout (another
``consolidate_state_dict(to=...)``, another ``reshard_after_forward``) or blame an innocent
rank (another mixed-precision policy). Now every rank raises, naming the setting and each
rank's value, and the world stays usable for the next case.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.ddp.replica_sync import ReplicaMismatchError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _raised(build: Any, expected: type[Exception] = ReplicaMismatchError) -> str:
    try:
        build()
    except expected as err:
        return str(err)
    return "no error"


def _zero_cases(rank: int) -> dict[str, Any]:
    Zero = lockstep.ZeroRedundancyOptimizer
    found: dict[str, Any] = {}
    found["lr"] = _raised(lambda: Zero(_model().parameters(), torch.optim.SGD, lr=0.1 + 0.4 * rank))
    found["cls"] = _raised(lambda: Zero(_model().parameters(),
                                        (torch.optim.SGD, torch.optim.Adam)[rank], lr=0.1))
    # The same value written as an int on one rank and a float on the other is the same.
    opt = Zero(_model().parameters(), torch.optim.SGD, lr=(1, 1.0)[rank], momentum=0.9)
    extra = nn.Linear(4, 4)
    found["group"] = _raised(lambda: opt.add_param_group(
        {"params": extra.parameters(), "momentum": 0.5 + 0.1 * rank}))
    found["groups_after"] = len(opt.param_groups)  # the refused group is not kept
    # consolidate_state_dict with another target per rank: raised on both, then it still works.
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    found["to"] = _raised(lambda: opt.consolidate_state_dict(to=rank), ValueError)
    found["to_outside"] = _raised(lambda: opt.consolidate_state_dict(to=2), ValueError)
    opt.consolidate_state_dict(to=0)
    found["consolidated"] = len(opt.state_dict()["state"]) if rank == 0 else None
    return found


def _fsdp_cases(rank: int) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def shard(inner: dict[str, Any], outer: dict[str, Any]) -> None:
        model = _model()
        lockstep.fully_shard(model[2], **inner)
        lockstep.fully_shard(model, **outer)
        model(torch.ones(2, 4)).float().sum().backward()

    found["reshard"] = _raised(lambda: shard({"reshard_after_forward": rank == 0}, {}))
    # None on one rank is the default a non-root unit gets (True): the same as True.
    shard({"reshard_after_forward": (True, None)[rank]}, {})
    bf16 = lockstep.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    policy = (bf16, lockstep.MixedPrecisionPolicy())[rank]
    found["param_dtype"] = _raised(lambda: shard({"mp_policy": policy}, {"mp_policy": policy}))
    reduce = lockstep.MixedPrecisionPolicy(reduce_dtype=(torch.float32, torch.float64)[rank])
    found["reduce_dtype"] = _raised(lambda: shard({"mp_policy": reduce}, {}))
    cast = lockstep.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=rank == 0)
    found["cast"] = _raised(lambda: shard({}, {"mp_policy": cast}))
    shard({"mp_policy": bf16}, {"mp_policy": bf16})  # the same policy everywhere still runs
    return found


def _worker(rank: int) -> dict[str, Any]:
    lockstep.init_distributed()
    try:
        return {**_zero_cases(rank), **_fsdp_cases(rank)}
    finally:
        lockstep.shutdown_distributed()


def test_ranks_that_disagree_are_told_on_every_rank():
    for rank, found in enumerate(lockstep.spawn(_worker, 2, timeout=120)):
        where = f"rank {rank}: {found}"
        assert "'lr' for param group 0 (0.1 on rank 0, 0.5 on rank 1)" in found["lr"], where
        assert ("optimizer_class: torch.optim.sgd.SGD on rank 0, torch.optim.adam.Adam on rank 1"
                in found["cls"]), where
        assert "'momentum' for param group 1 (0.5 on rank 0, 0.6 on rank 1)" in found["group"], where
        assert found["groups_after"] == 1, where
        assert "different targets (to: 0 on rank 0, 1 on rank 1)" in found["to"], where
        assert "to=2 is not a rank of the process group (size 2)" in found["to_outside"], where
        assert found["consolidated"] == (6 if rank == 0 else None), where
        assert ("reshard_after_forward for the unit '2' (True on rank 0, False on rank 1)"
                in found["reshard"]), where
        assert "param_dtype for the unit '<root>' (bfloat16 on rank 0, None on rank 1)" in found["param_dtype"], where
        assert "reduce_dtype for the unit '2' (float32 on rank 0, float64 on rank 1)" in found["reduce_dtype"], where
        assert ("cast_forward_inputs for the unit '<root>' (True on rank 0, False on rank 1)"
                in found["cast"]), where
