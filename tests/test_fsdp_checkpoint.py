"""Tests of lockstep.fsdp.checkpoint: fully sharded checkpoints through lockstep.Checkpointer.

A world of 2 trains the transformer of test_fsdp two AdamW steps, saves sharded (each rank its
piece) and full (consolidated on rank 0), and goes on to step 4 uninterrupted. New processes at
world 2 restore each form and reach step 4 with parameters torch.equal to the uninterrupted run;
at world 3, and in this process into an unsharded plain model and plain AdamW, they match a single
process trained on the whole batch (AdamW state resharded: exp_avg, exp_avg_sq, step). A 2x2
hybrid world writes one copy of the shards (replica 0's) and restores at world 4 hybrid and at
world 2; a model with a 0-dim parameter (a learnable temperature) saves, in the full form, a plain
AdamW state dict and restores at worlds 2 and 3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_fsdp import ADAMW, TOL, TinyGPT, _batches, _loss, _mine, _model, _shard

import lockstep
from lockstep.checkpoint.io import read_verified
from lockstep.checkpoint.sharded import ShardFiles, shard_ranks, shard_writers, writes_shard
from lockstep.fsdp import ModelState, OptimizerState, full_state_dict
from lockstep.fsdp.checkpoint import read_range

SAVE_AT, STEPS = 2, 4
FORMS = {"sharded": False, "full": True}


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int, rank: int, size: int) -> None:
    for x, y in _batches(STEPS)[first:last]:
        opt.zero_grad()
        _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
        opt.step()


class ScaledGPT(TinyGPT):
    """TinyGPT whose logits are divided by a learnable 0-dim temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) / self.temperature


def _new_model(scaled: bool = False) -> TinyGPT:
    if not scaled:
        return _model()
    torch.manual_seed(0)
    return ScaledGPT().to(torch.float64)


def _reference(scaled: bool = False, steps: int = STEPS) -> dict[str, torch.Tensor]:
    return _plain_run(scaled, steps)[0].state_dict()


def _plain_run(scaled: bool, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _new_model(scaled)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _steps(model, opt, 0, steps, 0, 1)
    return model, opt


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


def test_shard_ranks_come_from_the_metadata_and_older_checkpoints_mean_every_rank(tmp_path):
    assert shard_ranks({"world_size": 4, "sharded": ["model"], "shard_ranks": [0, 1]}) == [0, 1]
    assert shard_ranks({"world_size": 3, "sharded": ["model"]}) == [0, 1, 2]  # written before the list
    assert shard_ranks({"world_size": 3, "sharded": []}) == []
    with pytest.raises(lockstep.CheckpointError, match="invalid shard_ranks"):
        shard_ranks({"world_size": 2, "sharded": ["model"], "shard_ranks": [0, 2]})
    assert shard_writers([False, True, False]) == [1] and not writes_shard([])
    with pytest.raises(lockstep.CheckpointError, match="rank 2 wrote no shard file"):
        ShardFiles(tmp_path, 4, [0, 1]).pieces(2)


def test_sharded_checkpoint_of_one_process_loads_into_a_plain_model(tmp_path):
    model = _shard(_model())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _steps(model, opt, 0, SAVE_AT, 0, 1)
    ckpt = lockstep.Checkpointer(tmp_path)
    ckpt.save(SAVE_AT, model=ModelState(model), optimizer=OptimizerState(model, opt))
    ckpt.wait()  # saves are asynchronous: the files are on disk once wait() returns
    assert sorted(p.name for p in (tmp_path / "step_000000000002").iterdir()) == [
        "rng-rank00000.pt", "shard-rank00000.pt", "state.pt"]
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
    ckpt.restore(model=ModelState(plain), optimizer=OptimizerState(plain, plain_opt))
    _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
    assert _diff(plain.state_dict(), _reference()) < TOL
    with pytest.raises(lockstep.CheckpointError, match="holds 'model' sharded"):
        ckpt.restore(model=_model())
    # A DDP around the plain model is the same model (it was refused: keys with `module.`)
    wrapped_plain = _model()
    lockstep.init_distributed()
    try:
        wrapped = lockstep.DistributedDataParallel(wrapped_plain)
        wrapped_opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
        ckpt.restore(model=ModelState(wrapped), optimizer=OptimizerState(wrapped, wrapped_opt))
    finally:
        lockstep.shutdown_distributed()
    _steps(wrapped_plain, wrapped_opt, SAVE_AT, STEPS, 0, 1)
    assert _diff(wrapped_plain.state_dict(), _reference()) < TOL
    # The sharded model or its optimizer given as they are would save rank 0's shards only.
    with pytest.raises(lockstep.CheckpointError, match=r"model=lockstep.fsdp.ModelState\(model\)"):
        ckpt.save(SAVE_AT + 1, model=model)
    with pytest.raises(lockstep.CheckpointError, match="an optimizer of lockstep.fully_shard's shards"):
        ckpt.save(SAVE_AT + 1, model=ModelState(model), optimizer=opt)
    with pytest.raises(lockstep.CheckpointError, match=r"Pass lockstep.fsdp.ModelState\(model\)"):
        ckpt.restore(model=model)


@pytest.mark.filterwarnings("ignore:skipping damaged checkpoint")
def test_damaged_shard_file_is_skipped_and_other_models_are_refused(tmp_path):
    model = _shard(_model())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ckpt = lockstep.Checkpointer(tmp_path)
    for step in (1, 2):
        _steps(model, opt, step - 1, step, 0, 1)
        ckpt.save(step, model=ModelState(model), optimizer=OptimizerState(model, opt))
    ckpt.wait()  # saves are asynchronous: the files are on disk once wait() returns
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


def _build(rank: int, *, scaled: bool = False, **shard_kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _shard(_new_model(scaled), **shard_kwargs)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _full_states(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The unsharded model and optimizer state dicts, on every rank (collectives of its shard group)."""
    optimizer = OptimizerState(model, opt, full=True)
    optimizer.consolidate_state_dict(to=dist.get_rank())
    return full_state_dict(model), optimizer.state_dict()


def _same(a: Any, b: Any) -> bool:
    """Nested dicts/lists equal, tensors torch.equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _hybrid_pair(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """2 x 2: shard inside {0, 1} and {2, 3}, replicate across {0, 2} and {1, 3}."""
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return replicate_groups[rank % 2], shard_groups[rank // 2]


def save_worker(rank: int, root: str) -> dict[str, torch.Tensor]:
    lockstep.init_distributed()
    size = dist.get_world_size()
    model, opt = _build(rank, group=_hybrid_pair(rank) if size == 4 else None)
    _steps(model, opt, 0, SAVE_AT, rank, size)
    for form, full in FORMS.items():
        lockstep.Checkpointer(f"{root}/{form}").save(
            SAVE_AT, model=ModelState(model, full=full), optimizer=OptimizerState(model, opt, full=full))
    _steps(model, opt, SAVE_AT, STEPS, rank, size)
    return full_state_dict(model)


def resume_worker(rank: int, root: str, saved_world: int = 2, scaled: bool = False) -> dict[str, Any]:
    """Restore each form into a new fully sharded model; its state then, and after step 4."""
    lockstep.init_distributed()
    size = dist.get_world_size()
    out: dict[str, Any] = {}
    for form in FORMS:
        model, opt = _build(rank, scaled=scaled)
        restored = lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(model), optimizer=OptimizerState(model, opt))
        assert restored is not None and restored.step == SAVE_AT and restored.world_size == saved_world
        out[f"{form}@restore"] = _full_states(model, opt)
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


def hybrid_worker(rank: int, root: str) -> dict[str, Any]:
    """2 x 2: save both forms at step 2, go on to step 4; then restore each in this same world."""
    lockstep.init_distributed()
    model, opt = _build(rank, group=_hybrid_pair(rank))
    _steps(model, opt, 0, SAVE_AT, rank, 4)
    for form, full in FORMS.items():
        lockstep.Checkpointer(f"{root}/{form}").save(
            SAVE_AT, model=ModelState(model, full=full), optimizer=OptimizerState(model, opt, full=full))
    out: dict[str, Any] = {"saved": _full_states(model, opt)}
    _steps(model, opt, SAVE_AT, STEPS, rank, 4)
    out["uninterrupted"] = full_state_dict(model)
    for form in FORMS:  # at world 4, hybrid again
        fresh, fresh_opt = _build(rank, group=_hybrid_pair(rank))
        lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(fresh), optimizer=OptimizerState(fresh, fresh_opt))
        out[f"{form}@restore"] = _full_states(fresh, fresh_opt)
        _steps(fresh, fresh_opt, SAVE_AT, STEPS, rank, 4)
        out[form] = full_state_dict(fresh)
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_hybrid_checkpoint_is_written_once_and_restores_at_world_four_and_two(tmp_path):
    root = str(tmp_path)
    ref = _reference()
    outs = lockstep.spawn(hybrid_worker, 4, (root,), timeout=120)
    saved = outs[0]["saved"]
    sharded = tmp_path / "sharded" / "step_000000000002"
    assert sorted(p.name for p in sharded.iterdir()) == [  # replica 0 (ranks 0, 1) writes the shards
        *(f"rng-rank{r:05d}.pt" for r in range(4)), "shard-rank00000.pt", "shard-rank00001.pt", "state.pt"]
    for rank, out in enumerate(outs):
        assert _diff(out["uninterrupted"], ref) < TOL
        assert _same(out["saved"], saved), rank  # the replicas held the same state
        for form in FORMS:
            assert _same(out[f"{form}@restore"], saved), (rank, form)
            assert _same(out[form], out["uninterrupted"]), (rank, form)  # same layout: bitwise
    for out in lockstep.spawn(resume_worker, 2, (root, 4), timeout=90):  # 2 x 2 -> 2
        for form in FORMS:
            assert _same(out[f"{form}@restore"], saved), form
            assert _diff(out[form], ref) < TOL, form
    for form in FORMS:  # 2 x 2 -> 1: into a plain model and a plain AdamW, in this process
        plain = _model()
        plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
        lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(plain), optimizer=OptimizerState(plain, plain_opt))
        assert _same(plain.state_dict(), saved[0]), form
        _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
        assert _diff(plain.state_dict(), ref) < TOL, form
    assert lockstep.Checkpointer(tmp_path / "sharded").latest() == sharded  # checksums of 2 shard files
    shard = sharded / "shard-rank00001.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="skipping damaged checkpoint.*shard-rank00001"):
        assert lockstep.Checkpointer(tmp_path / "sharded").latest() is None


def subgroup_worker(rank: int, root: str) -> dict[str, Any] | None:
    """World 3: ranks 1 and 2 shard a model over their own group and checkpoint it with that group."""
    lockstep.init_distributed()
    group = dist.new_group([1, 2])  # every rank creates it; rank 0 takes no part after
    if rank == 0:
        dist.barrier()  # rank 0 hosts the store the Checkpointer's meetings use: stay until the others end
        return None
    me = dist.get_rank(group)
    model, opt = _build(rank, group=group)
    _steps(model, opt, 0, SAVE_AT, me, 2)
    for form, full in FORMS.items():
        lockstep.Checkpointer(f"{root}/{form}", process_group=group).save(
            SAVE_AT, model=ModelState(model, full=full), optimizer=OptimizerState(model, opt, full=full))
    out: dict[str, Any] = {"saved": full_state_dict(model)}
    for form in FORMS:
        fresh, fresh_opt = _build(rank, group=group)
        lockstep.Checkpointer(f"{root}/{form}", process_group=group).restore(
            model=ModelState(fresh), optimizer=OptimizerState(fresh, fresh_opt))
        _steps(fresh, fresh_opt, SAVE_AT, STEPS, me, 2)
        out[form] = full_state_dict(fresh)
    dist.barrier()
    return out


@pytest.mark.multirank
def test_checkpointer_with_its_own_group_names_and_finds_files_by_group_rank(tmp_path):
    # The files are named by rank in the Checkpointer's group; the shards used to record global
    # ranks (1, 2), so nothing was written as the values of global rank 0 and restoring looked
    # for shard-rank00002.pt.
    root = str(tmp_path)
    ref = _reference()
    outs = lockstep.spawn(subgroup_worker, 3, (root,), timeout=120)
    assert outs[0] is None
    files = sorted(p.name for p in (tmp_path / "sharded" / "step_000000000002").iterdir())
    assert files == ["rng-rank00000.pt", "rng-rank00001.pt", "shard-rank00000.pt",
                     "shard-rank00001.pt", "state.pt"]
    for out in outs[1:]:
        for form in FORMS:
            assert _diff(out[form], ref) < TOL, form
    for form in FORMS:  # and into a plain model in this process
        plain = _model()
        plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
        lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(plain), optimizer=OptimizerState(plain, plain_opt))
        assert _same(plain.state_dict(), outs[1]["saved"]), form
        _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
        assert _diff(plain.state_dict(), ref) < TOL, form


def scalar_worker(rank: int, root: str) -> dict[str, Any]:
    """A 0-dim temperature: save both forms at step 2, go on; restore in this world; NAdam's scalars."""
    lockstep.init_distributed()
    model, opt = _build(rank, scaled=True)
    _steps(model, opt, 0, SAVE_AT, rank, 2)
    for form, full in FORMS.items():
        lockstep.Checkpointer(f"{root}/{form}").save(
            SAVE_AT, model=ModelState(model, full=full), optimizer=OptimizerState(model, opt, full=full))
    out: dict[str, Any] = {"saved": _full_states(model, opt)}
    _steps(model, opt, SAVE_AT, STEPS, rank, 2)
    out["uninterrupted"] = full_state_dict(model)
    for form in FORMS:
        fresh, fresh_opt = _build(rank, scaled=True)
        lockstep.Checkpointer(f"{root}/{form}").restore(
            model=ModelState(fresh), optimizer=OptimizerState(fresh, fresh_opt))
        out[f"{form}@restore"] = _full_states(fresh, fresh_opt)
        _steps(fresh, fresh_opt, SAVE_AT, STEPS, rank, 2)
        out[form] = full_state_dict(fresh)
    # NAdam keeps a scalar ``mu_product`` per parameter: for the 0-dim one it must stay a scalar
    # on every rank, not become a run of one element held by rank 0 only.
    model = _shard(_new_model(scaled=True))
    nadam = torch.optim.NAdam(model.parameters(), lr=1e-2)
    _steps(model, nadam, 0, 1, rank, 2)
    consolidated = OptimizerState(model, nadam, full=True)
    consolidated.consolidate_state_dict(to=rank)
    fresh_model = _shard(_new_model(scaled=True))
    fresh_nadam = torch.optim.NAdam(fresh_model.parameters(), lr=1e-2)
    OptimizerState(fresh_model, fresh_nadam).load_state_dict(consolidated.state_dict())
    out["mu_product"] = [(tuple(s["mu_product"].shape), s["mu_product"].item()) for s in fresh_nadam.state.values()]
    out["mu_product_saved"] = [(tuple(s["mu_product"].shape), s["mu_product"].item()) for s in nadam.state.values()]
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_zero_dim_parameter_full_form_is_a_plain_adamw_state_dict(tmp_path):
    root = str(tmp_path)
    plain, plain_opt = _plain_run(scaled=True, steps=SAVE_AT)
    ref = _reference(scaled=True)
    outs = lockstep.spawn(scalar_worker, 2, (root,), timeout=90)
    state = read_verified(tmp_path / "full" / "step_000000000002" / "state.pt")["objects"]
    for saved, expected in ((state["model"], plain.state_dict()), (state["optimizer"], plain_opt.state_dict())):
        _close(saved, expected)  # the same keys in the same order, shapes, dtypes; values to TOL
    position = [p is plain.temperature for p in plain.parameters()].index(True)
    assert state["optimizer"]["state"][position]["exp_avg"].dim() == 0
    for out in outs:
        assert _diff(out["uninterrupted"], ref) < TOL
        for form in FORMS:
            assert _same(out[f"{form}@restore"], outs[0]["saved"]), form
            assert _same(out[form], out["uninterrupted"]), form  # world 2 -> 2: bitwise
        assert out["mu_product"] == out["mu_product_saved"]
        assert all(shape == () for shape, _ in out["mu_product"])
    for out in lockstep.spawn(resume_worker, 3, (root, 2, True), timeout=90):  # 2 -> 3
        for form in FORMS:
            assert _same(out[f"{form}@restore"], outs[0]["saved"]), form
            assert _diff(out[form], ref) < TOL, form
    plain = _new_model(scaled=True)  # 2 -> 1: the full form into a plain AdamW as it is
    plain_opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
    lockstep.Checkpointer(tmp_path / "full").restore(model=plain, optimizer=plain_opt)
    _steps(plain, plain_opt, SAVE_AT, STEPS, 0, 1)
    assert _diff(plain.state_dict(), ref) < TOL


def _close(saved: Any, expected: Any) -> None:
    """Nested state dicts alike: keys in the same order, tensors of one shape and dtype, to TOL."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(saved, torch.Tensor) and saved.shape == expected.shape and saved.dtype == expected.dtype
        assert (saved.double() - expected.double()).abs().max().item() < TOL
    elif isinstance(expected, dict):
        assert isinstance(saved, dict) and list(saved) == list(expected)
        for key in expected:
            _close(saved[key], expected[key])
    elif isinstance(expected, list):
        assert len(saved) == len(expected)
        for a, b in zip(saved, expected):
            _close(a, b)
    else:
        assert saved == expected
