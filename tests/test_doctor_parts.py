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


def test_an_optimizer_stepped_inside_another_is_one_step():
    """torch's ZeroRedundancyOptimizer steps its inner optimizer, then syncs the parameters:
    that sync is optimizer time, not the next step's data."""
    model = torch.nn.Linear(2, 2)
    calls: list[str] = []
    watch = OptimizerWatch(model.parameters(), lambda: calls.append("start"),
                           lambda: calls.append("end"))

    class Outer(torch.optim.SGD):
        def step(self, closure=None):
            inner.step()
            calls.append("sync")

    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = Outer(model.parameters(), lr=0.1)
    _step(outer)
    _step(inner)  # alone, it is a step of its own
    assert calls == ["start", "sync", "end", "start", "end"]
    watch.close()


def test_backward_start_is_marked_by_whichever_output_the_loss_uses():
    from lockstep.ddp.backward_end import hook_backward_start

    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    out = model(x)
    aux, logits = out.mean(1), out * 2  # the loss uses the second output only
    marks: list[int] = []
    assert hook_backward_start((aux, logits), lambda: marks.append(1)) == 2
    logits.sum().backward(retain_graph=True)
    assert marks == [1]  # once per backward, though the output had one hooked tensor per use
    (logits.sum() + aux.sum()).backward()
    assert marks == [1, 1]


def test_a_step_of_accumulated_micro_batches_counts_all_their_samples():
    """Two micro-batches of 8 under no_sync() then a synced one: 16 samples per step (the plan
    prices samples per second from it); a second forward of the same batch before one backward
    (two views, a contrastive loss) brings no new samples."""
    from lockstep.doctor.recorder import Recorder

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(torch.device("cpu"), model.parameters(), warmup=0)
    for _ in range(3):
        for synced in (False, True):
            x = torch.randn(8, 2)
            recorder.forward_started((x,))
            recorder.forward_ended()
            recorder.backward_started()
            recorder.backward_ended(synced=synced)
        _step(optimizer)
    assert recorder.batch_size == 16
    views = Recorder(torch.device("cpu"), model.parameters(), warmup=0)
    for _ in range(3):
        for _view in range(2):
            views.forward_started((torch.randn(8, 2),))
            views.forward_ended()
        views.backward_started()
        views.backward_ended(synced=True)
        _step(optimizer)
    assert views.batch_size == 8
    recorder.close()
    views.close()


def _micro_batch(recorder, n: int = 8) -> None:
    recorder.forward_started((torch.randn(n, 2),))
    recorder.forward_ended()
    recorder.backward_started()
    recorder.backward_ended(synced=True)


def test_accumulating_without_no_sync_before_the_first_optimizer_step_is_one_step():
    """Three synced backwards then the optimizer's step: one step of 24 samples from the very
    first (it was three steps of 8 until the optimizer had stepped once, so `--steps` stopped a
    run early and the batch read 8); a script with no torch optimizer still ends a step at each
    backward."""
    from lockstep.doctor.recorder import Recorder

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(torch.device("cpu"), model.parameters(), warmup=0)
    for _ in range(2):
        for _micro in range(3):
            _micro_batch(recorder)
        _step(optimizer)
    assert recorder.step_count == 2 and recorder.batch_size == 24
    assert [len(s.backwards) for s in recorder.steps] == [3, 3]
    recorder.close()

    lazy = torch.nn.Linear(2, 2)  # the optimizer is made after the first backwards
    late = Recorder(torch.device("cpu"), lazy.parameters(), warmup=0)
    for _micro in range(3):
        _micro_batch(late)
    made = torch.optim.SGD(lazy.parameters(), lr=0.1)
    _step(made)
    for _micro in range(3):
        _micro_batch(late)
    _step(made)
    assert late.step_count == 2 and late.batch_size == 24
    assert [len(s.backwards) for s in late.steps] == [3, 3]
    assert [len(s.forwards) for s in late.steps] == [3, 3]
    late.close()

    by_hand = torch.nn.Linear(2, 2)  # updated without an optimizer
    manual = Recorder(torch.device("cpu"), by_hand.parameters(), warmup=0)
    for _ in range(4):
        _micro_batch(manual)
    _micro_batch(manual)
    assert manual.step_count == 4 and manual.batch_size == 8
    manual.close()
