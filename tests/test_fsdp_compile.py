"""``torch.compile`` over a ``fully_shard``-ed model, in a world of two on gloo/CPU.

The root's start-up check (one exchange of parameter names and shapes) pickles Python objects,
which Dynamo cannot trace: it runs outside the compiled graph, so a model may be compiled
before its first eager forward (until 2026-11-29 that first compiled call crashed inside
Dynamo with an ``UnsafeScriptObjectError`` about the process group).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lockstep
from lockstep.fsdp import full_state_dict

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(STEPS)]


def _compiled_training(rank: int, eager_steps: int) -> dict[str, torch.Tensor]:
    warnings.filterwarnings("ignore")  # Dynamo's notes on builtins it does not trace
    lockstep.init_distributed()
    model = _net()
    lockstep.fully_shard(model[0])
    lockstep.fully_shard(model[2])
    lockstep.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    for step, x in enumerate(_batches()):
        run = model if step < eager_steps else compiled
        run(x[2 * rank : 2 * rank + 2]).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: t.clone() for name, t in full_state_dict(model).items()}


def _reference() -> dict[str, torch.Tensor]:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        (model(x).pow(2).sum() / 2).backward()  # the mean of the two ranks' sums
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.multirank
@pytest.mark.parametrize("eager_steps", [
    pytest.param(0, id="compiled-from-the-start"),
    pytest.param(1, id="after-an-eager-step", marks=pytest.mark.slow),
])
def test_compiled_sharded_model_matches_one_process(eager_steps):
    results = lockstep.spawn(_compiled_training, 2, args=(eager_steps,), timeout=240)
    expected = _reference()
    for state in results:
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-12, msg=name)
