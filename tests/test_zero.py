"""Tests of lockstep.ZeroRedundancyOptimizer (ZeRO-1 and ZeRO-2).

Tiers: state-dict arithmetic without processes; a world of one in this process (errors,
schedulers, checkpoints); worlds of 2 and 3 on gloo through ``lockstep.spawn``, each running
every equivalence check in one world against a single-process reference; GPU variants.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.zero import state as zstate
from lockstep.zero.gradients import grad_bytes

STEPS = 4  # optimizer steps per phase
BATCH = 12  # divisible by worlds 1, 2 and 3, so shards are equal and means match
TOL = 1e-10  # float64 models: only summation order differs from the reference


# -- shared bodies (module level: spawned workers import them) -------------------------------


def _model(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(device=device, dtype=torch.float64)


def _batches(n: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)
        out.append((x.to(device), y.to(device)))
    return out


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _state_diff(ours: dict, theirs: dict) -> float:
    """Largest difference between two optimizer state dicts; inf if their layout differs."""
    if ours["param_groups"] != theirs["param_groups"]:
        return float("inf")
    if ours["state"].keys() != theirs["state"].keys():
        return float("inf")
    worst = 0.0
    for index, per_param in theirs["state"].items():
        for key, value in per_param.items():
            mine = ours["state"][index][key]
            diff = torch.as_tensor(mine).cpu() - torch.as_tensor(value).cpu()
            worst = max(worst, diff.abs().max().item())
    return worst


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for per_param in opt.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


@dataclass(frozen=True)
class _World:
    """Where a check runs: this process's rank in ``group``, the group's size, the device."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        size = len(t) // self.size
        return t[self.rank * size : (self.rank + 1) * size]

    def ddp(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        return lockstep.DistributedDataParallel(model, process_group=self.group, **kwargs)

    def zero(self, params: Any, cls: type, **kwargs: Any) -> torch.optim.Optimizer:
        return lockstep.ZeroRedundancyOptimizer(params, cls, process_group=self.group, **kwargs)


_ADAM = {"lr": 1e-2, "weight_decay": 1e-2}


def _check_adam_with_ddp(w: _World, out: dict) -> tuple:
    """ZeRO-1 Adam under DDP with a scheduler equals plain Adam on the whole batch."""
    ref = _model(w.device)
    ref_opt = torch.optim.Adam(ref.parameters(), **_ADAM)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    model = w.ddp(_model(w.device))
    opt = w.zero(model.parameters(), torch.optim.Adam, **_ADAM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in _batches(STEPS, w.device):
        _train_step(ref, ref_opt, x, y)
        ref_sched.step()
        _train_step(model, opt, w.shard(x), w.shard(y))
        sched.step()
    out["adam_param_diff"] = _max_diff(model.module, ref)
    out["adam_lr"] = (opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])
    out["adam_state_bytes"] = (_state_bytes(opt), _state_bytes(ref_opt))
    return model, opt, sched, ref_opt


def _check_sgd_bucket_view(w: _World, out: dict) -> None:
    """ZeRO-1 SGD with momentum, parameters as bucket views, equals plain SGD."""
    ref = _model(w.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    model = w.ddp(_model(w.device))
    opt = w.zero(
        model.parameters(), torch.optim.SGD, parameters_as_bucket_view=True, lr=0.05, momentum=0.9
    )
    for x, y in _batches(STEPS, w.device):
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, w.shard(x), w.shard(y))
    out["sgd_view_param_diff"] = _max_diff(model.module, ref)


def _check_mixed_dtypes(w: _World, out: dict) -> None:
    """Parameters of several dtypes (one bucket per owner and dtype), with and without views."""
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float32, torch.float64]
    for view in (False, True):
        gen = torch.Generator().manual_seed(2)
        init = [torch.randn(4 + i, generator=gen).to(w.device, dt) for i, dt in enumerate(dtypes)]
        ref = [t.clone().requires_grad_() for t in init]
        ours = [t.clone().requires_grad_() for t in init]
        ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
        opt = w.zero(ours, torch.optim.SGD, parameters_as_bucket_view=view, lr=0.1, momentum=0.9)
        for _ in range(3):
            for params, o in ((ref, ref_opt), (ours, opt)):
                o.zero_grad()
                sum((p.float() ** 3).sum() for p in params).backward()
                o.step()
        out[f"mixed_dtype_diff_view{view}"] = max(
            (p.double() - q.double()).abs().max().item() for p, q in zip(ours, ref)
        )
        out[f"mixed_dtype_ok_view{view}"] = all(p.dtype == q.dtype for p, q in zip(ours, ref))


def _check_zero2_plain_model(w: _World, out: dict) -> None:
    """ZeRO-2 on an unwrapped model, with a group added mid-training, equals plain Adam."""
    ref, model = _model(w.device), _model(w.device)
    for m in (ref, model):
        m[4].requires_grad_(False)  # frozen at first, unfrozen and added after two steps
    ref_opt = torch.optim.Adam([{"params": list(ref[:4].parameters())}], lr=1e-2)
    first = [{"params": list(model[:4].parameters())}]
    opt = w.zero(first, torch.optim.Adam, reduce_gradients=True, lr=1e-2)
    for step, (x, y) in enumerate(_batches(STEPS, w.device)):
        if step == 2:
            for m, o in ((ref, ref_opt), (model, opt)):
                m[4].requires_grad_(True)
                o.add_param_group({"params": list(m[4].parameters()), "lr": 5e-3})
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, w.shard(x), w.shard(y))
    out["zero2_param_diff"] = _max_diff(model, ref)
    held = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if p.grad is not None]
    # After step() an owner holds world_size x the averaged gradient: its share of the next
    # average, should the gradients be carried into the next step.
    diffs = [(p.grad / w.size - q.grad).abs().max().item() for p, q in held]
    out["zero2_grad_diff"] = max(diffs, default=0.0)
    out["zero2_grads_held"] = len(held)
    out["zero2_grads_owned"] = sum(len(g["params"]) for g in opt.optim.param_groups)
    out["zero2_grad_bytes"] = (
        grad_bytes(list(model.parameters())), grad_bytes(list(ref.parameters()))
    )
    out["zero2_groups_lr"] = [g["lr"] for g in opt.param_groups]


def _check_zero2_ddp_no_sync(w: _World, out: dict) -> None:
    """ZeRO-2 with DDP inside no_sync over two micro-batches equals one plain SGD step."""
    ref = _model(w.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    model = w.ddp(_model(w.device), gradient_as_bucket_view=False)
    opt = w.zero(model.parameters(), torch.optim.SGD, reduce_gradients=True, lr=0.05, momentum=0.9)
    for x, y in _batches(STEPS, w.device):
        _train_step(ref, ref_opt, x, y)
        opt.zero_grad()
        with model.no_sync():
            for xm, ym in zip(w.shard(x).chunk(2), w.shard(y).chunk(2)):
                (F.mse_loss(model(xm), ym) / 2).backward()
        opt.step()
    out["zero2_ddp_param_diff"] = _max_diff(model.module, ref)


def _check_zero2_carried_and_clipped(w: _World, out: dict) -> None:
    """ZeRO-2 with gradients carried into the next step (no zero_grad between steps) and with
    clip_grad_norm_ before each step: the same as plain SGD with torch's clipping."""
    for mode in ("carried", "clipped", "skipped"):
        clip = mode != "carried"
        ref, model = _model(w.device), _model(w.device)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        opt = w.zero(model.parameters(), torch.optim.SGD, reduce_gradients=True, lr=0.05, momentum=0.9)
        norms = []
        for step, (x, y) in enumerate(_batches(STEPS, w.device)):
            if clip or step == 0:  # without clipping, zeroed once: the gradients carry over
                ref_opt.zero_grad()
                opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            F.mse_loss(model(w.shard(x)), w.shard(y)).backward()
            if clip:
                expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                norms.append(abs(opt.clip_grad_norm_(0.05).item() - expected.item()))
            if mode == "skipped" and step == 0:
                # Clipped, then skipped (a non-finite norm, GradScaler's skip): until
                # 2026-11-29 the next step's gradients were never averaged.
                continue
            ref_opt.step()
            opt.step()
        out[f"zero2_{mode}_diff"] = _max_diff(model, ref)
        if clip:
            out[f"zero2_{mode}_norm_diff"] = max(norms)


def _check_zero2_group_from_rank0(w: _World, out: dict) -> None:
    """A group added to ZeRO-2 starts from rank 0's values, as the model's first parameters do."""
    model = _model(w.device)
    head = nn.Linear(3, 2).to(w.device, torch.float64)
    with torch.no_grad():
        head.weight.fill_(float(w.rank))  # each rank's own, unsynchronised initialisation
    opt = w.zero(model.parameters(), torch.optim.SGD, reduce_gradients=True, lr=0.05)
    opt.add_param_group({"params": list(head.parameters())})
    out["zero2_added_from_rank0"] = bool((head.weight == 0).all())


def _check_swapped_order(w: _World, out: dict) -> None:
    """Two same-shaped parameters passed in another order on one rank: refused on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(w.device)
    params = list(model.parameters())
    if w.rank == 1:
        params[0], params[2] = params[2], params[0]  # the two 4x4 weights
    try:
        w.zero(params, torch.optim.SGD, lr=0.1)
    except RuntimeError as exc:
        out["order_error"] = str(exc)


def _check_checkpoint(w: _World, parts: tuple, ckpt_out: str | None, out: dict) -> None:
    """Consolidate on rank 0 (matching the plain optimizer's state dict) and save a checkpoint."""
    model, opt, sched, ref_opt = parts
    opt.consolidate_state_dict(to=0)
    if w.rank == 0:
        full = opt.state_dict()
        out["consolidated_diff"] = _state_diff(full, ref_opt.state_dict())
        if ckpt_out:
            ckpt = {"model": model.state_dict(), "optim": full, "sched": sched.state_dict()}
            torch.save(ckpt, ckpt_out)
    else:
        try:
            opt.state_dict()
        except RuntimeError as exc:
            out["state_dict_error"] = str(exc)


def _check_resume(w: _World, ckpt_in: str, out: dict) -> None:
    """Load a checkpoint saved at another world size, continue, and match 2*STEPS plain steps."""
    batches = _batches(2 * STEPS, w.device)
    ref = _model(w.device)
    ref_opt = torch.optim.Adam(ref.parameters(), **_ADAM)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for x, y in batches:
        _train_step(ref, ref_opt, x, y)
        ref_sched.step()
    ckpt = torch.load(ckpt_in, weights_only=False)
    base = _model(w.device)
    base.load_state_dict(ckpt["model"])
    model = w.ddp(base)
    opt = w.zero(model.parameters(), torch.optim.Adam, **_ADAM)
    opt.load_state_dict(ckpt["optim"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched.load_state_dict(ckpt["sched"])
    for x, y in batches[STEPS:]:
        _train_step(model, opt, w.shard(x), w.shard(y))
        sched.step()
    out["resume_param_diff"] = _max_diff(model.module, ref)
    last = w.size - 1
    opt.consolidate_state_dict(to=last)
    if w.rank == last:
        out["resume_state_diff"] = _state_diff(opt.state_dict(), ref_opt.state_dict())


def _check_mismatch(w: _World, out: dict) -> None:
    """Ranks passing different parameters all get the same error instead of a hang."""
    params = [torch.zeros(3 + (w.rank == 1), requires_grad=True)]
    try:
        w.zero(params, torch.optim.SGD, lr=0.1)
    except RuntimeError as exc:
        out["mismatch_error"] = str(exc)


def _run_checks(w: _World, ckpt_in: str | None, ckpt_out: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"world": w.size}
    parts = _check_adam_with_ddp(w, out)
    _check_checkpoint(w, parts, ckpt_out, out)
    _check_sgd_bucket_view(w, out)
    _check_mixed_dtypes(w, out)
    _check_zero2_plain_model(w, out)
    _check_zero2_ddp_no_sync(w, out)
    _check_zero2_carried_and_clipped(w, out)
    _check_zero2_group_from_rank0(w, out)
    if ckpt_in:
        _check_resume(w, ckpt_in, out)
    if w.size > 1:
        _check_mismatch(w, out)
        _check_swapped_order(w, out)
    return out


def zero_worker(rank: int, device: str | None, ckpt: str) -> dict[str, dict]:
    """Every multi-rank check, run first in a pair of ranks, then in the whole world.

    The pair is the subgroup of global ranks 1 and 2 (so group ranks differ from global ones);
    its checkpoint is resumed by the whole world. One spawn for both keeps the test fast.
    """
    info = lockstep.init_distributed(device=device)
    results: dict[str, dict] = {}
    if info.world_size >= 3:
        pair = dist.new_group([1, 2])  # every rank must take part in creating it
        if rank in (1, 2):
            results["pair"] = _run_checks(_World(rank - 1, 2, info.device, pair), None, ckpt)
        dist.barrier()  # the pair's checkpoint is on disk before anyone reads it
    resume = ckpt if info.world_size >= 3 else None
    results["world"] = _run_checks(_World(rank, info.world_size, info.device), resume, None)
    return results


# -- tier 1: state-dict arithmetic, no processes ---------------------------------------------


def test_global_indices_number_parameters_across_groups():
    assert zstate.global_indices([2, 0, 3]) == [[0, 1], [], [2, 3, 4]]


def test_shard_state_rekeys_globally_and_snapshots_on_cpu():
    live = torch.ones(2)
    shard = zstate.shard_state({0: {"exp_avg": live, "step": 3}}, local_to_global=[5])
    live.add_(1)  # optimizers update state in place; the snapshot must not follow
    assert shard[5]["step"] == 3
    assert torch.equal(shard[5]["exp_avg"], torch.ones(2))


def test_local_state_dict_picks_the_owned_positions_and_keeps_hyperparameters():
    full = {
        "state": {0: {"m": 0}, 2: {"m": 2}, 3: {"m": 3}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2, 3]}],
    }
    local = zstate.local_state_dict(full, owned=[[1], [2, 3]])
    assert local["state"] == {1: {"m": 2}, 2: {"m": 3}}
    assert local["param_groups"] == [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1, 2]}]


def test_full_state_dict_matches_plain_optimizer_layout():
    groups = [{"lr": 0.1, "params": ["a", "b"]}, {"lr": 0.2, "params": ["c"]}]
    full = zstate.full_state_dict(groups, {2: {"m": 1}, 0: {"m": 0}})
    assert full == {
        "state": {0: {"m": 0}, 2: {"m": 1}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
    }


@pytest.mark.parametrize(
    ("full", "message"),
    [
        ({"state": {}}, r"lacks \['param_groups'\]"),
        (
            {"state": {}, "param_groups": [{"params": [0]}]},
            "has 1 parameter groups, this optimizer has 2",
        ),
        (
            {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]},
            "parameter group 1 has 1 parameters in the loaded state dict but 2",
        ),
    ],
)
def test_check_compatible_names_the_difference(full, message):
    with pytest.raises(ValueError, match=message):
        zstate.check_compatible(full, [1, 2])


# -- tier 2: a world of one in this process --------------------------------------------------


@pytest.fixture
def world_of_one():
    info = lockstep.init_distributed(device="cpu")
    try:
        yield info
    finally:
        lockstep.shutdown_distributed()


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"call lockstep.init_distributed\(\) first"):
        lockstep.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"optimizer_class": torch.optim.Adam(_model().parameters())}, TypeError,
         "must be a torch.optim.Optimizer subclass.*not an instance"),
        ({"optimizer_class": dict}, TypeError, "must be a torch.optim.Optimizer subclass"),
        ({"params": []}, ValueError, "empty parameter list"),
        ({"params": [{"params": []}]}, ValueError, "without any parameter"),
        ({"params": torch.zeros(2, requires_grad=True)}, TypeError, "got a single tensor"),
        ({"params": 5}, TypeError, r"iterable of tensors or dicts \(e.g. model.parameters\(\)\), got int"),
        ({"params": [torch.zeros(2, requires_grad=True),
                     torch.zeros(2, device="meta", requires_grad=True)]},
         ValueError, "parameter 1 of group 0 is on meta but parameter 0 is on cpu"),
        ({"overlap_with_ddp": True}, ValueError,
         "overlap_with_ddp=True is not supported.*reduce_gradients"),
    ],
)
def test_constructor_errors_name_the_culprit(world_of_one, kwargs, error, message):
    args = {"params": _model().parameters(), "optimizer_class": torch.optim.SGD, "lr": 0.1}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        lockstep.ZeroRedundancyOptimizer(**args)


def test_nccl_with_cpu_parameters_is_refused():
    from lockstep.zero.optimizer import _check_backend

    _check_backend("gloo", torch.device("cpu"))
    _check_backend("nccl", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="on cpu but the process group uses NCCL"):
        _check_backend("nccl", torch.device("cpu"))


def test_checkpoint_errors(world_of_one):
    opt = lockstep.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1)
    no_state = r"rank 0 holds no consolidated.*consolidate_state_dict\(to=0\)"
    with pytest.raises(RuntimeError, match=no_state):
        opt.state_dict()
    with pytest.raises(ValueError, match="to=1 is not a rank of the process group"):
        opt.consolidate_state_dict(to=1)
    opt.consolidate_state_dict()
    opt.step()
    stale = "consolidated optimizer state is from step 0 but .* 1 steps"
    with pytest.raises(RuntimeError, match=stale):
        opt.state_dict()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1).state_dict()
    with pytest.raises(ValueError, match="parameter group 0 has 2 parameters .* but 6"):
        opt.load_state_dict(other)


def test_sparse_gradient_is_refused_in_zero2(world_of_one):
    emb = nn.Embedding(5, 3, sparse=True)
    opt = lockstep.ZeroRedundancyOptimizer(
        emb.parameters(), torch.optim.SGD, reduce_gradients=True, lr=0.1
    )
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter 0 \(shape \(5, 3\)\) has a sparse gradient"):
        opt.step()


def test_sparse_parameter_is_refused_at_construction(world_of_one):
    # Before #30 it was accepted and step() failed on its owner while the peers timed out.
    sparse = torch.zeros(4, 2).to_sparse().requires_grad_()
    with pytest.raises(ValueError, match="parameter 1 of group 0 is a sparse tensor"):
        lockstep.ZeroRedundancyOptimizer(
            [torch.zeros(2, requires_grad=True), sparse], torch.optim.SGD, lr=0.1
        )


class _ScaledSGD(torch.optim.SGD):
    """An optimizer whose step takes an extra keyword, as some torch optimizers' do."""

    def step(self, closure=None, *, scale: float = 1.0):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return super().step(closure)


def test_step_passes_keyword_arguments_to_the_local_optimizer(world_of_one):
    # Before #30 step(scale=...) raised TypeError; torch hands extra keywords to the local step.
    ref, model = _model(), _model()
    ref_opt = _ScaledSGD(ref.parameters(), lr=0.1)
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), _ScaledSGD, lr=0.1)
    x, y = _batches(1)[0]
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step(scale=0.5)
    assert _max_diff(model, ref) == 0.0


def test_world_of_one_equals_plain_adam_and_its_state_dict(world_of_one):
    ref, model = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), **_ADAM)
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, **_ADAM)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # the wrapped optimizer's defaults show
    for x, y in _batches(STEPS):
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
    assert _max_diff(model, ref) == 0.0
    opt.consolidate_state_dict()
    assert _state_diff(opt.state_dict(), ref_opt.state_dict()) == 0.0


def test_one_cycle_with_momentum_cycles_the_shard_s_betas(world_of_one):
    """OneCycleLR(cycle_momentum=True) checks the optimizer's defaults for betas or momentum:
    the wrapped optimizer's show there (torch's ZeRO, holding only the arguments given, is
    refused; so was lockstep's), and the cycled betas reach the shard's optimizer."""
    ref, model = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    assert opt.defaults["betas"] == (0.9, 0.999)
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1)
                 for o in (ref_opt, opt)]
    for x, y in _batches(STEPS):
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
        for schedule in schedules:
            schedule.step()
    assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"] != (0.9, 0.999)
    assert _max_diff(model, ref) == 0.0


def test_state_dict_hooks_run_as_torch_runs_them(world_of_one):
    opt = lockstep.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.Adam, **_ADAM)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": calls.append("save_post") or 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.consolidate_state_dict()
    saved = opt.state_dict()
    assert saved["tag"] == 1  # what a post-hook returns is the state dict
    opt.load_state_dict(saved)
    assert calls == ["save_pre", "save_post", "load_pre", "load_post"]


def test_closure_is_evaluated_and_its_loss_returned(world_of_one):
    for reduce_gradients in (False, True):
        model = _model()
        opt = lockstep.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, reduce_gradients=reduce_gradients, lr=0.1
        )
        x, y = _batches(1)[0]

        def closure(opt=opt, model=model, x=x, y=y) -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        before = copy.deepcopy(model)
        loss = opt.step(closure)
        assert loss.item() == pytest.approx(F.mse_loss(before(x), y).item())
        assert _max_diff(model, before) > 0


# -- tier 3: a world of 3 on gloo, and a pair of its ranks as a subgroup ---------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zero") / "pair.pt"


@pytest.fixture(scope="module")
def spawned(checkpoint) -> list[dict[str, dict]]:
    return lockstep.spawn(zero_worker, 3, args=("cpu", str(checkpoint)), timeout=120)


@pytest.fixture(scope="module")
def pair(spawned) -> list[dict]:
    """Results of the subgroup of global ranks 1 and 2, indexed by group rank."""
    return [spawned[1]["pair"], spawned[2]["pair"]]


@pytest.fixture(scope="module")
def world3(spawned) -> list[dict]:
    return [out["world"] for out in spawned]


def _check_equivalences(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        where = f"rank {rank} of {out['world']}"
        assert out["adam_param_diff"] < TOL, where
        assert out["adam_lr"][0] == out["adam_lr"][1] == 2.5e-3, where
        assert out["sgd_view_param_diff"] < TOL, where
        assert out["zero2_param_diff"] < TOL, where
        assert out["zero2_grad_diff"] < TOL, where
        assert out["zero2_groups_lr"] == [1e-2, 5e-3], where
        assert out["zero2_ddp_param_diff"] < TOL, where
        assert out["zero2_carried_diff"] < TOL and out["zero2_clipped_diff"] < TOL, where
        assert out["zero2_skipped_diff"] < TOL and out["zero2_skipped_norm_diff"] < TOL, where
        assert out["zero2_clipped_norm_diff"] < TOL and out["zero2_added_from_rank0"], where
        for view in (False, True):
            assert out[f"mixed_dtype_diff_view{view}"] == 0.0, where
            assert out[f"mixed_dtype_ok_view{view}"], where


def _check_sharded_memory(results: list[dict]) -> None:
    world = len(results)
    state = [out["adam_state_bytes"] for out in results]
    plain = state[0][1]
    assert sum(ours for ours, _ in state) == plain  # every state tensor lives on exactly one rank
    assert all(ours < plain for ours, _ in state)
    # ZeRO-2: each rank keeps only the gradients of the parameters it owns.
    assert all(out["zero2_grads_held"] == out["zero2_grads_owned"] for out in results)
    grads = [out["zero2_grad_bytes"] for out in results]
    assert sum(ours for ours, _ in grads) == grads[0][1]
    assert max(ours for ours, _ in grads) < grads[0][1] * (1 / world + 0.25)


def test_pair_subgroup_steps_equal_plain_optimizers(pair):
    _check_equivalences(pair)


def test_pair_subgroup_shards_state_and_gradients(pair):
    _check_sharded_memory(pair)


def test_consolidated_state_dict_equals_plain_and_is_only_on_target(pair):
    assert pair[0]["consolidated_diff"] < TOL
    assert "rank 1 holds no consolidated optimizer state" in pair[1]["state_dict_error"]


def test_mismatched_parameters_fail_on_every_rank(pair, world3):
    for out in pair + world3:
        assert "rank 1 passed different parameters from rank 0" in out["mismatch_error"]
        first = "(0, 0, (3,), 'torch.float32') vs (0, 0, (4,), 'torch.float32')"
        assert first in out["mismatch_error"]


def test_parameters_in_another_order_fail_on_every_rank(pair, world3):
    for out in pair + world3:
        assert "rank 1 passed different parameters from rank 0: the same values in another order" \
            in out["order_error"], out.get("order_error")


def test_world3_steps_equal_plain_optimizers(world3):
    _check_equivalences(world3)
    _check_sharded_memory(world3)


def test_checkpoint_from_pair_resumes_at_world3(world3):
    for out in world3:
        assert out["resume_param_diff"] < TOL
    assert world3[2]["resume_state_diff"] < TOL


def test_checkpoint_from_pair_resumes_in_a_plain_optimizer_and_at_world1(
    spawned, checkpoint, world_of_one
):
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), **_ADAM)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    batches = _batches(2 * STEPS)
    for x, y in batches:
        _train_step(ref, ref_opt, x, y)
        ref_sched.step()
    for zero in (False, True):
        # Loaded fresh each time: a plain optimizer's state aliases the tensors it loads.
        ckpt = torch.load(checkpoint, weights_only=False)
        model = _model()
        model.load_state_dict(ckpt["model"])
        if zero:
            opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, **_ADAM)
        else:
            opt = torch.optim.Adam(model.parameters(), **_ADAM)
        opt.load_state_dict(ckpt["optim"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        sched.load_state_dict(ckpt["sched"])
        for x, y in batches[STEPS:]:
            _train_step(model, opt, x, y)
            sched.step()
        assert _max_diff(model, ref) < TOL, f"zero={zero}"


# -- tier 4: GPU (NCCL) ----------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_checks_on_every_gpu(tmp_path):
    world = min(torch.cuda.device_count(), 3)
    args = (None, str(tmp_path / "pair.pt"))
    spawned = lockstep.spawn(zero_worker, world, args=args, timeout=120)
    results = [out["world"] for out in spawned]
    _check_equivalences(results)
    if world > 1:
        _check_sharded_memory(results)


def test_join_names_the_optimizer_it_cannot_shadow(world_of_one):
    from torch.distributed.algorithms import Join

    model = lockstep.DistributedDataParallel(nn.Linear(2, 2))
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="not a Joinable yet"), Join([model, opt]):
        pass


def test_torch_s_read_only_attributes_read_alike(world_of_one):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    for view in (False, True):
        ours = lockstep.ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD,
                                                parameters_as_bucket_view=view, lr=0.1)
        theirs = TorchZero(_model().parameters(), torch.optim.SGD, parameters_as_bucket_view=view, lr=0.1)
        for name in ("parameters_as_bucket_view", "global_rank", "initialized", "rank", "world_size"):
            assert getattr(ours, name) == getattr(theirs, name), name


def test_a_refused_group_is_not_left_half_added(world_of_one):
    model = _model()
    opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    sparse = nn.Parameter(torch.zeros(3, 2).to_sparse())
    with pytest.raises(ValueError, match="sparse tensor"):
        opt.add_param_group({"params": [sparse]})
    assert len(opt.param_groups) == 1  # until 2026-11-29 the group stayed, in no shard
    x, y = _batches(1)[0]
    _train_step(model, opt, x, y)


def test_complex_parameters_are_checked_without_a_casting_warning(world_of_one):
    param = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real" until 2026-11-29
        lockstep.ZeroRedundancyOptimizer([param], torch.optim.SGD, lr=0.1)
