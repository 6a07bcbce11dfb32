"""Tests of lockstep.fsdp.checkpoint: fully sharded checkpoints through lockstep.Checkpointer.

A world of 2 trains the transformer of test_fsdp two AdamW steps, saves sharded (each rank its
piece) and full (consolidated on rank 0), and goes on to step 4 uninterrupted. New processes at
world 2 restore each form and reach step 4 with parameters torch.equal to the uninterrupted run;
at world 3, and in this process into an unsharded plain model and plain AdamW, they match a single
process trained on the whole batch (AdamW state resharded: exp_avg, exp_avg_sq, step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_fsdp import ADAMW, TOL, _batches, _loss, _mine, _model, _shard

import lockstep
from lockstep.fsdp import ModelState, OptimizerState, full_state_dict
from lockstep.fsdp.checkpoint import read_range

SAVE_AT, STEPS = 2, 4
FORMS = {"sharded": False, "full": True}


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int, rank: int, size: int) -> None:
    for x, y in _batches(STEPS)[first:last]:
        opt.zero_grad()
        _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
        opt.step()


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    _steps(model, torch.optim.AdamW(model.parameters(), **ADAMW), 0, STEPS, 0, 1)
    return model.state_dict()


def _diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert set(state) == set(ref)
    return max((state[k] - ref[k]).abs().max().item() for k in ref)


# -- tier 1: pure logic and a world of one ---------------------------------------------------------


def test_read_range_reassembles_any_run_from_runs_of_another_world():
    full = torch.arange(100.0)
    for saved_world in (1, 2, 3, 7):
        chunk = -(-100 // saved_world)
        pieces = [full[q * chunk : (q + 1) * chunk] for q in range(saved_world)]
        for start, end in ((0, 100), (34, 67), (99, 100), (50, 50)):
            got = read_range(pieces, start, end, chunk, list(range(saved_world)), lambda p: p)
            assert torch.equal(got, full[start:end]), (saved_world, start, end)


def test_sharded_checkpoint_of_one_process_loads_into_a_plain_model(tmp_path):
    model = _shard(_model())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _steps(model, opt, 0, SAVE_AT, 0, 1)
    ckpt = lockstep.Checkpointer(tmp_path)
    ckpt.save(SAVE_AT, model=ModelState(model), optimizer=OptimizerState(model, opt))
    assert sorted(p.name for p in (tmp_path / "step_000000000002").iterdir()) == [
        "rng-rank00000.pt", "shard-rank00000.pt", "state.pt"]
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
    ckpt.restore(model=ModelState(plain), optimizer=OptimizerState(plain, plain_opt))
    _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
    assert _diff(plain.state_dict(), _reference()) < TOL
    with pytest.raises(lockstep.CheckpointError, match="holds 'model' sharded"):
        ckpt.restore(model=_model())


@pytest.mark.filterwarnings("ignore:skipping damaged checkpoint")
def test_damaged_shard_file_is_skipped_and_other_models_are_refused(tmp_path):
    model = _shard(_model())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ckpt = lockstep.Checkpointer(tmp_path)
    for step in (1, 2):
        _steps(model, opt, step - 1, step, 0, 1)
        ckpt.save(step, model=ModelState(model), optimizer=OptimizerState(model, opt))
    shard = tmp_path / "step_000000000002" / "shard-rank00000.pt"
    shard.write_bytes(shard.read_bytes()[:-10])  # cut short: the checksum catches it
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        restored = ckpt.restore(model=ModelState(_shard(_model())))
    assert restored is not None and restored.step == 1
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(lockstep.CheckpointError, match=r"missing: \['0.bias', '0.weight'\]"):
        lockstep.Checkpointer(tmp_path).restore(model=ModelState(other))
    fewer = torch.optim.AdamW([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
    with pytest.raises(lockstep.CheckpointError, match="parameter groups of sizes"):
        lockstep.Checkpointer(tmp_path).restore(optimizer=OptimizerState(model, fewer))


# -- multi-rank ---------------------------------------------------------------------------------


def _build(rank: int, **shard_kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _shard(_model(), **shard_kwargs)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _hybrid_pair(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """2 x 2: shard inside {0, 1} and {2, 3}, replicate across {0, 2} and {1, 3}."""
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return replicate_groups[rank % 2], shard_groups[rank // 2]


def save_worker(rank: int, root: str) -> dict[str, torch.Tensor]:
    lockstep.init_distributed()
    size = dist.get_world_size()
    model, opt = _build(rank, **({"group": _hybrid_pair(rank)} if size == 4 else {}))
    _steps(model, opt, 0, SAVE_AT, rank, size)
    for form, full in FORMS.items():
        lockstep.Checkpointer(f"{root}/{form}").save(
            SAVE_AT, model=ModelState(model, full=full), optimizer=OptimizerState(model, opt, full=full))
    _steps(model, opt, SAVE_AT, STEPS, rank, size)
    return full_state_dict(model)


def resume_worker(rank: int, root: str, saved_world: int = 2) -> dict[str, Any]:
    lockstep.init_distributed()
    size = dist.get_world_size()
    out: dict[str, Any] = {}
    for form in FORMS:
        model, opt = _build(rank)
        restored = lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(model), optimizer=OptimizerState(model, opt))
        assert restored is not None and restored.step == SAVE_AT and restored.world_size == saved_world
        _steps(model, opt, SAVE_AT, STEPS, rank, size)
        out[form] = full_state_dict(model)
    return out


@pytest.mark.multirank
def test_checkpoints_resume_bitwise_and_at_other_world_sizes(tmp_path):
    root = str(tmp_path)
    uninterrupted = lockstep.spawn(save_worker, 2, (root,), timeout=90)[0]
    ref = _reference()
    assert _diff(uninterrupted, ref) < TOL
    files = sorted(p.name for p in (tmp_path / "sharded" / "step_000000000002").iterdir())
    assert files == ["rng-rank00000.pt", "rng-rank00001.pt", "shard-rank00000.pt",
                     "shard-rank00001.pt", "state.pt"]
    files = sorted(p.name for p in (tmp_path / "full" / "step_000000000002").iterdir())
    assert files == ["rng-rank00000.pt", "rng-rank00001.pt", "state.pt"]  # consolidated on rank 0
    for out in lockstep.spawn(resume_worker, 2, (root,), timeout=90):  # same world: bitwise
        for form in FORMS:
            assert all(torch.equal(out[form][k], uninterrupted[k]) for k in ref), form
    for out in lockstep.spawn(resume_worker, 3, (root,), timeout=90):  # 2 -> 3
        for form in FORMS:
            assert _diff(out[form], ref) < TOL, form
    for form, full in FORMS.items():  # 2 -> 1, into a plain model and a plain AdamW
        plain = _model()
        plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
        objects: dict[str, Any] = {"model": plain, "optimizer": plain_opt}
        if not full:  # the full form is a plain state dict: no wrapping needed
            objects = {"model": ModelState(plain), "optimizer": OptimizerState(plain, plain_opt)}
        lockstep.Checkpointer(f"{root}/{form}").restore(**objects)
        assert plain_opt.state[plain.blocks[0].up.weight]["exp_avg"].shape == (21, 10)
        _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
        assert _diff(plain.state_dict(), ref) < TOL, form


@pytest.mark.multirank
def test_hybrid_checkpoint_restores_fully_sharded_at_world_two(tmp_path):
    root = str(tmp_path)
    ref = _reference()
    assert _diff(lockstep.spawn(save_worker, 4, (root,), timeout=90)[0], ref) < TOL
    for out in lockstep.spawn(resume_worker, 2, (root, 4), timeout=90):  # 2 x 2 -> 2
        for form in FORMS:
            assert _diff(out[form], ref) < TOL, form
