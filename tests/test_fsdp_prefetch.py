"""Tests of lockstep.fsdp.prefetch: the next unit's all-gather starts before the current computes.

Order is read from :func:`lockstep.fsdp.record_events` (never from timings): in the second step
the gather of block k+1 is issued before block k's forward begins, backward gathers the block it
reaches next before the current block's gradients are reduced, each block's reduce-scatter is
issued before the backward of the block before it begins and waited only at the end. Prefetch on
and off give bitwise-equal parameters after AdamW steps at worlds 2 and 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_fsdp import ADAMW, _batches, _loss, _mine, _model, _shard

import lockstep
from lockstep.fsdp import full_state_dict, record_events, set_prefetch

STEPS = 3


def _at(events: list[tuple[str, str]], event: str, unit: str) -> int:
    return events.index((event, unit))


def _train(rank: int, size: int, prefetch: bool) -> tuple[dict[str, torch.Tensor], list]:
    model = _shard(_model())
    set_prefetch(model, prefetch)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    steps = []
    for x, y in _batches(STEPS):
        opt.zero_grad()
        with record_events(model) as events:
            _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
        steps.append(events)
        opt.step()
    return full_state_dict(model), steps


def _check_order(events: list[tuple[str, str]]) -> None:
    """The second step's events with prefetch: gathers run one unit ahead, reductions overlap."""
    # forward: root, blocks.0, blocks.1; the gather of the next starts before this one computes
    assert _at(events, "gather-issued", "blocks.0") < _at(events, "forward-begin", "")
    assert _at(events, "gather-issued", "blocks.1") < _at(events, "forward-begin", "blocks.0")
    assert _at(events, "gather-issued", "blocks.1") < _at(events, "gather-waited", "blocks.1")
    backward = events[_at(events, "forward-end", ""):]
    # backward: root, blocks.1, blocks.0; the next gather starts before this unit's gradients
    assert _at(backward, "gather-issued", "blocks.1") < _at(backward, "backward-begin", "")
    assert _at(backward, "gather-issued", "blocks.0") < _at(backward, "backward-begin", "blocks.1")
    assert _at(backward, "gather-issued", "blocks.0") < _at(backward, "reduce-issued", "blocks.1")
    # reduce-scatters start as each unit finishes and are waited for only at the end
    assert _at(backward, "reduce-issued", "blocks.1") < _at(backward, "backward-begin", "blocks.0")
    last_issue = max(i for i, (e, _) in enumerate(backward) if e == "reduce-issued")
    first_wait = min(i for i, (e, _) in enumerate(backward) if e == "reduce-waited")
    assert last_issue < first_wait
    assert [e for e, _ in backward].count("reduce-waited") == 3


def test_one_process_prefetches_after_the_first_step_and_not_when_off():
    state_on, on = _train(0, 1, True)
    state_off, off = _train(0, 1, False)
    first = on[0]  # the first step records the order: every gather is waited at once
    assert _at(first, "gather-waited", "blocks.1") == _at(first, "gather-issued", "blocks.1") + 1
    _check_order(on[1])
    for step in off:  # off: each gather is issued only when its own unit needs it
        for i, (event, unit) in enumerate(step):
            if event == "gather-issued":
                assert step[i + 1] == ("gather-waited", unit)
    assert all(torch.equal(state_on[k], state_off[k]) for k in state_on)


def prefetch_worker(rank: int) -> dict:
    lockstep.init_distributed()
    size = dist.get_world_size()
    state_on, on = _train(rank, size, True)
    state_off, _ = _train(rank, size, False)
    _check_order(on[1])
    _check_order(on[2])
    return {"equal": all(torch.equal(state_on[k], state_off[k]) for k in state_on),
            "changed": not torch.equal(state_on["blocks.0.up.weight"], _model().state_dict()["blocks.0.up.weight"])}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_on_equals_off_bitwise(world):
    for out in lockstep.spawn(prefetch_worker, world, timeout=90):
        assert out["equal"] and out["changed"]
