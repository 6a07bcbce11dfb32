"""The recorder's parts on their own: the optimizer watch and the per-rank profile file."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from lockstep.doctor.optimizer_watch import OptimizerWatch
from lockstep.doctor.rank_file import RankFile


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()


def test_watch_times_only_the_optimizers_of_its_parameters():
    mine, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    calls: list[str] = []
    watch = OptimizerWatch(mine.parameters(), lambda: calls.append("start"), lambda: calls.append("end"))
    ours = torch.optim.SGD([*other.parameters(), mine.weight], lr=0.1)  # one of ours is enough
    theirs = torch.optim.SGD(other.parameters(), lr=0.1)
    _step(theirs)
    assert calls == [] and not watch.owns(theirs)
    _step(ours)
    assert calls == ["start", "end"] and watch.owns(ours)
    watch.close()
    watch.close()  # idempotent
    _step(ours)
    assert calls == ["start", "end"]


def test_a_dropped_watch_leaves_empty_hooks_not_itself():
    model = torch.nn.Linear(2, 2)
    calls: list[str] = []

    class Owner:
        def __init__(self) -> None:
            self.watch = OptimizerWatch(model.parameters(), self.started, lambda: None)

        def started(self) -> None:
            calls.append("start")

    owner = Owner()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(optimizer)
    assert calls == ["start"]
    del owner
    gc.collect()  # owner <-> watch is a cycle: only the collector frees it
    _step(optimizer)
    assert calls == ["start"]


def test_rank_file_writes_once_per_new_step_and_ends_a_bounded_run(tmp_path):
    steps = [3]
    payloads = []

    def payload() -> dict:
        payloads.append(steps[0])
        return {"steps": steps[0]}

    rank_file = RankFile(tmp_path / "out", 1, payload, lambda: steps[0])
    try:
        assert rank_file.save() == tmp_path / "out" / "rank1.json"
        assert rank_file.save() is None  # same step count: not rewritten
        steps[0] = 5
        with pytest.raises(SystemExit) as ended:
            rank_file.end_bounded_run()
        assert ended.value.code == 0
        assert json.loads((tmp_path / "out" / "rank1.json").read_text()) == {"steps": 5}
        assert payloads == [3, 5] and not list((tmp_path / "out").glob("*.tmp"))
    finally:
        rank_file.close()
