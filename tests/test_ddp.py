"""DistributedDataParallel against a single-process reference, on gloo ranks.

Each scenario runs K steps of lockstep DDP on per-rank shards and, in the same process, K steps
of a plain copy of the model on all shards at once (loss = mean of the per-shard losses, which is
what averaging the ranks' gradients computes). Parameters must agree within float tolerance.
Scenarios are batched into one spawned world per world size to keep the suite fast.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep

STEPS = 4
TOL = 1e-5


# ---- models ------------------------------------------------------------------------------
class TinyTransformer(nn.Module):
    """Embedding tied to the output head: one parameter reached through two paths."""

    def __init__(self, vocab: int = 23, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


class Branchy(nn.Module):
    """A frozen layer, a globally unused head, and a branch only some ranks take."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)

    def forward(self, x, use_branch: bool = True):
        h = self.trunk(self.frozen(x))
        return self.branch(h) if use_branch else h


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 64)  # 16 KB of float32: larger than the tiny buckets below
        self.wide = nn.Linear(64, 8).double()

    def forward(self, x):
        return self.wide(self.big(x).double()).float()


class OutOfOrder(nn.Module):
    """Layers used in another order than registered: rebuilt buckets differ from the first ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 40)
        self.b = nn.Linear(40, 3)
        self.c = nn.Linear(10, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.c(x))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# ---- the equivalence harness -------------------------------------------------------------
def _batches(kind: str, step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "tokens":
        x = torch.randint(0, 23, (world * 2, 7), generator=g)
        return x.chunk(world), x.roll(1, dims=1).chunk(world)
    dims = {"mlp": (10, 3), "ooo": (10, 3), "branchy": (6, 6), "mixed": (64, 8), "bn": (5, 2)}[kind]
    x, y = torch.randn(world * 3, dims[0], generator=g), torch.randn(world * 3, dims[1], generator=g)
    return x.chunk(world), y.chunk(world)


def _loss(kind: str, model: nn.Module, x, y, rank: int) -> torch.Tensor:
    if kind == "tokens":
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    if kind == "branchy":
        return F.mse_loss(model(x, use_branch=rank == 0), y)
    return F.mse_loss(model(x), y)


def _equivalence(kind: str, build, opt_cls, **ddp_kwargs) -> float:
    """Largest parameter difference between DDP and the single-process reference after K steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different initial weights per rank: construction must broadcast
    model = build()
    torch.manual_seed(0)
    reference = build()
    ddp = lockstep.DistributedDataParallel(model, **ddp_kwargs)
    reference.load_state_dict(model.state_dict())  # rank 0's weights after the broadcast
    opt, ref_opt = opt_cls(ddp.parameters()), opt_cls(reference.parameters())
    for step in range(STEPS):
        xs, ys = _batches(kind, step, world)
        opt.zero_grad()
        _loss(kind, ddp, xs[rank], ys[rank], rank).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(_loss(kind, reference, xs[r], ys[r], r) for r in range(world)) / world).backward()
        ref_opt.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _no_sync_accumulation() -> tuple[float, float]:
    """Two micro-batches under no_sync, one synced: equals the mean over every micro-batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001)
    micro = [_batches("mlp", step, world) for step in range(3)]
    with ddp.no_sync():
        for xs, ys in micro[:2]:
            F.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    local = model[0].weight.grad.clone()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    spread_before_sync = max((g - gathered[0]).abs().max().item() for g in gathered)
    xs, ys = micro[2]
    F.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    for xs, ys in micro:
        (sum(F.mse_loss(reference(xs[r]), ys[r]) for r in range(world)) / world).backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return spread_before_sync, diff


def _unused_and_frozen() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy()
    ddp = lockstep.DistributedDataParallel(model, find_unused_parameters=True)
    kept = torch.full_like(model.never.weight, 7.0)
    model.never.weight.grad = kept.clone()
    xs, ys = _batches("branchy", 0, dist.get_world_size())
    F.mse_loss(ddp(xs[rank], use_branch=rank == 0), ys[rank]).backward()
    return {
        "frozen_grad_is_none": model.frozen.weight.grad is None,
        "never_kept": torch.equal(model.never.weight.grad, kept),
        "never_bias_none": model.never.bias.grad is None,
        "branch_has_grad": model.branch.weight.grad is not None,
    }


def _buffers_follow_rank0() -> tuple[bool, float]:
    """BatchNorm statistics are rank 0's before each forward; with equal data, DDP == one process."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, reference = _bn_net(), None
    reference = copy.deepcopy(model)
    model[1].running_mean.fill_(float(rank))  # differs per rank: construction must fix it
    reference[1].running_mean.fill_(0.0)
    ddp = lockstep.DistributedDataParallel(model)
    opt, ref_opt = _sgd(ddp.parameters()), _sgd(reference.parameters())
    for step in range(STEPS):
        xs, ys = _batches("bn", step, 1)  # the same batch on every rank
        opt.zero_grad()
        F.mse_loss(ddp(xs[0]), ys[0]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(xs[0]), ys[0]).backward()
        ref_opt.step()
    mean = model[1].running_mean.clone()
    everyone = [torch.empty_like(mean) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mean)
    same = all(torch.equal(m, everyone[0]) for m in everyone)
    diff = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    return same, diff


def _torch_hooks_and_timing() -> tuple[float, float, int]:
    """torch's own comm hooks run under lockstep's DDP; step timing records every iteration."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rank, world = dist.get_rank(), dist.get_world_size()
    diffs = []
    for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        torch.manual_seed(0)
        model = _mlp()
        reference = copy.deepcopy(model)
        ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001)
        ddp.register_comm_hook(None, hook)
        ddp.enable_step_timing()
        xs, ys = _batches("mlp", 0, world)
        F.mse_loss(ddp(xs[rank]), ys[rank]).backward()
        (sum(F.mse_loss(reference(xs[r]), ys[r]) for r in range(world)) / world).backward()
        diffs.append(max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())))
    return diffs[0], diffs[1], len(ddp.step_timings)


def _rebuild_follows_arrival() -> bool:
    torch.manual_seed(0)
    model = _mlp()
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001)
    xs, ys = _batches("mlp", 0, dist.get_world_size())
    F.mse_loss(ddp(xs[dist.get_rank()]), ys[dist.get_rank()]).backward()
    reducer = ddp._reducer
    first = [i for b in reducer.buckets for i in b.param_indices]
    # Gradients arrive from the last layer backwards; views must still hold them after the move.
    views_ok = all(p.grad.data_ptr() == reducer.buckets[reducer._where[i][0]].views[reducer._where[i][1]].data_ptr()
                   for i, p in enumerate(reducer.params))
    return first[0] in (4, 5) and views_ok


def _rebuild_changes_buckets() -> float:
    torch.manual_seed(0)
    ddp = lockstep.DistributedDataParallel(OutOfOrder(), bucket_cap_mb=0.0015)
    before = [b.param_indices for b in ddp._reducer.buckets]
    xs, ys = _batches("ooo", 0, dist.get_world_size())
    F.mse_loss(ddp(xs[dist.get_rank()]), ys[dist.get_rank()]).backward()
    after = [b.param_indices for b in ddp._reducer.buckets]
    assert len(before) != len(after), (before, after)
    return _equivalence("ooo", OutOfOrder, _sgd, bucket_cap_mb=0.0015)


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time: a backward that dies half-way."""

    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("deliberate failure inside backward")
        return grad


def _robustness() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001)
    ddp.enable_step_timing()
    xs, ys = _batches("mlp", 0, world)
    # 1. a backward that raises after some gradients arrived; the next one must still work.
    # The failing node sits before the model, so every parameter's gradient arrives first.
    out = ddp(_FailOnce.apply(xs[rank].clone().requires_grad_()))
    try:
        F.mse_loss(out, ys[rank]).backward()
    except RuntimeError:
        pass
    model.zero_grad()
    F.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    (sum(F.mse_loss(reference(xs[r]), ys[r]) for r in range(world)) / world).backward()
    after_failure = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    # 2. a no_sync iteration is timed too.
    before = len(ddp.step_timings)
    with ddp.no_sync():
        F.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    timed_no_sync = len(ddp.step_timings) - before
    # 3. assign=True would replace the hooked parameters.
    try:
        ddp.load_state_dict(model.state_dict(), assign=True)
        assign_refused = False
    except ValueError as exc:
        assign_refused = "assign=True" in str(exc)
    return {"after_failure": after_failure, "timed_no_sync": timed_no_sync, "assign_refused": assign_refused}


def _scenarios(rank: int) -> dict:
    lockstep.init_distributed()
    out = {
        "robustness": _robustness(),
        "rebuild_changes_buckets": _rebuild_changes_buckets(),
        "mlp": _equivalence("mlp", _mlp, _sgd),
        "mlp_small_buckets": _equivalence("mlp", _mlp, _sgd, bucket_cap_mb=0.001),
        "mlp_no_views": _equivalence("mlp", _mlp, _adam, gradient_as_bucket_view=False),
        # SGD here: Adam turns the attention key bias's zero-in-theory gradient (numerical noise)
        # into full-size steps, which would compare noise, not DDP.
        "transformer_tied": _equivalence("tokens", TinyTransformer, _sgd, bucket_cap_mb=0.005),
        "branchy_unused": _equivalence("branchy", Branchy, _sgd, find_unused_parameters=True),
        "branchy_unused_no_views": _equivalence(
            "branchy", Branchy, _sgd, find_unused_parameters=True, gradient_as_bucket_view=False),
        "mixed_dtypes": _equivalence("mixed", MixedDtypes, _adam, bucket_cap_mb=0.004),
        "no_sync": _no_sync_accumulation(),
        "unused": _unused_and_frozen(),
        "buffers": _buffers_follow_rank0(),
        "hooks": _torch_hooks_and_timing(),
        "rebuild": _rebuild_follows_arrival(),
    }
    return out


EQUIVALENCE = ["rebuild_changes_buckets", "mlp", "mlp_small_buckets", "mlp_no_views", "transformer_tied", "branchy_unused",
               "branchy_unused_no_views", "mixed_dtypes"]


@pytest.fixture(scope="module")
def world2():
    return lockstep.spawn(_scenarios, 2, timeout=150)


@pytest.mark.parametrize("name", EQUIVALENCE)
def test_equivalence_world2(world2, name):
    for rank_result in world2:
        assert rank_result[name] < TOL, f"{name}: DDP differs from one process by {rank_result[name]}"


def test_no_sync_accumulates_then_averages(world2):
    for spread, diff in (r["no_sync"] for r in world2):
        assert spread > 1e-4, "grads under no_sync should differ across ranks (no communication)"
        assert diff < TOL


def test_unused_and_frozen_parameters(world2):
    for r in world2:
        assert r["unused"] == {"frozen_grad_is_none": True, "never_kept": True,
                               "never_bias_none": True, "branch_has_grad": True}


def test_buffers_broadcast_from_rank0(world2):
    for same, diff in (r["buffers"] for r in world2):
        assert same and diff < TOL


def test_torch_comm_hooks_and_step_timing(world2):
    for plain, fp16, timings in (r["hooks"] for r in world2):
        assert plain < TOL and fp16 < 1e-3 and timings == 1


def test_failed_backward_timing_and_assign(world2):
    for r in world2:
        assert r["robustness"]["after_failure"] < TOL
        assert r["robustness"]["timed_no_sync"] == 1 and r["robustness"]["assign_refused"]


def test_buckets_rebuilt_in_arrival_order(world2):
    assert all(r["rebuild"] for r in world2)


def _world3(rank: int) -> dict:
    lockstep.init_distributed()
    return {
        "mlp": _equivalence("mlp", _mlp, _sgd, bucket_cap_mb=0.001),
        "transformer_tied": _equivalence("tokens", TinyTransformer, _sgd),
        "branchy_unused": _equivalence("branchy", Branchy, _sgd, find_unused_parameters=True),
        "no_sync": _no_sync_accumulation()[1],
    }


def test_equivalence_world3():
    for result in lockstep.spawn(_world3, 3, timeout=150):
        assert all(v < TOL for v in result.values()), result


def _debug_mode_checks_every_bucket(rank: int) -> tuple[int, int, float]:
    from lockstep.diagnose import collective_checks

    lockstep.init_distributed()
    calls = []
    original = collective_checks.check_collective
    collective_checks.check_collective = lambda *a, **k: (calls.append(a[0]), original(*a, **k))
    try:
        diff = _equivalence("mlp", _mlp, _sgd, bucket_cap_mb=0.001)
    finally:
        collective_checks.check_collective = original
    return len(calls), len(set(calls)), diff


def test_debug_collectives_mode_checks_each_bucket(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_DEBUG_COLLECTIVES", "1")
    for calls, distinct, diff in lockstep.spawn(_debug_mode_checks_every_bucket, 2, timeout=90):
        assert distinct >= 2 and calls == distinct * STEPS and diff < TOL


# ---- errors ------------------------------------------------------------------------------
def _different_models(rank: int) -> None:
    lockstep.init_distributed()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5 if rank == 1 else 4))
    lockstep.DistributedDataParallel(model)


def test_mismatched_parameters_name_rank_and_parameter():
    with pytest.raises(lockstep.WorkerError, match=r"rank 1 holds different parameters than rank 0: "
                       r"parameter '1.weight' has shape \[5, 4\], rank 0 has \[4, 4\]"):
        lockstep.spawn(_different_models, 2, timeout=60)


def _unused_without_flag(rank: int) -> None:
    lockstep.init_distributed()
    torch.manual_seed(0)
    model = Branchy()
    ddp = lockstep.DistributedDataParallel(model)
    xs, ys = _batches("branchy", 0, 2)
    F.mse_loss(ddp(xs[rank]), ys[rank]).backward()


def test_unused_parameters_without_flag_is_a_clear_error():
    with pytest.raises(lockstep.WorkerError, match=r"computed no gradient for 2 parameter\(s\).*"
                       r"'never.weight', 'never.bias'.*find_unused_parameters=True"):
        lockstep.spawn(_unused_without_flag, 2, timeout=60)


# ---- one process ---------------------------------------------------------------------------
@pytest.fixture
def world1():
    lockstep.init_distributed()
    yield
    lockstep.shutdown_distributed()


def test_world_of_one_communicates_nothing_and_matches_bare(world1):
    torch.manual_seed(0)
    model = _mlp()
    bare = copy.deepcopy(model)
    ddp = lockstep.DistributedDataParallel(model)
    assert ddp._reducer is None
    x = torch.randn(4, 10)
    ddp(x).sum().backward()
    bare(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), bare.parameters()))


def test_state_dict_has_no_prefix_and_loads_torch_checkpoints(world1):
    model = lockstep.DistributedDataParallel(_mlp())
    assert set(model.state_dict()) == set(model.module.state_dict())
    torch_style = {f"module.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(torch_style)
    assert all(float(v.abs().sum()) == 0 for v in model.state_dict().values())


def test_a_holder_of_the_wrapper_loads_its_own_state_dict_with_torchs_keys(world1):
    """A container holding the wrapper, torch.compile's wrapper and AveragedModel get torch's
    keys for it (`ddp.module.0.weight`) and load their own state dict back (the keys lacked
    `module.` and the load failed on missing keys); torch's positional form too."""
    holder = nn.Sequential()
    holder.add_module("ddp", lockstep.DistributedDataParallel(_mlp()))
    torch_holder = nn.Sequential()
    torch_holder.add_module("ddp", nn.parallel.DistributedDataParallel(_mlp()))
    assert list(holder.state_dict()) == list(torch_holder.state_dict())
    holder.load_state_dict(holder.state_dict())
    averaged = torch.optim.swa_utils.AveragedModel(holder.ddp)
    averaged.load_state_dict(averaged.state_dict())
    with pytest.warns(FutureWarning):
        positional = holder.ddp.state_dict(collections.OrderedDict(), "ckpt.")
    assert list(positional) == [f"ckpt.{k}" for k in torch_holder.ddp.state_dict()]
    assert set(holder.ddp.state_dict()) == set(holder.ddp.module.state_dict())  # unchanged


def test_join_context_can_be_entered_again(world1):
    """torch's Join made once can be used every epoch; lockstep's join() was a one-shot
    generator context (the second `with` raised AttributeError)."""
    model = lockstep.DistributedDataParallel(_mlp())
    context = model.join()
    for _ in range(2):
        with context:
            model(torch.randn(2, 10)).sum().backward()


def test_a_wrapped_module_is_refused(world1):
    """DDP of a DDP: with gradient views (lockstep's default) the two reducers gave wrong
    gradients that changed from run to run; refused at construction, naming the submodule."""
    with pytest.raises(TypeError, match="the module is already a DistributedDataParallel"):
        lockstep.DistributedDataParallel(lockstep.DistributedDataParallel(_mlp()))
    inner = nn.Sequential(nn.parallel.DistributedDataParallel(_mlp()))
    with pytest.raises(TypeError, match="its submodule '0' is already a DistributedDataParallel"):
        lockstep.DistributedDataParallel(inner)


def test_step_timing_at_world_one(world1):
    model = lockstep.DistributedDataParallel(_mlp())
    model.enable_step_timing()
    for _ in range(2):
        model(torch.randn(4, 10)).sum().backward()
    assert len(model.step_timings) == 2
    timing = model.step_timings[0]
    assert timing.forward_s > 0 and timing.backward_s > 0 and timing.exposed_comm_s == 0


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="call lockstep.init_distributed"):
        lockstep.DistributedDataParallel(_mlp())


def test_frozen_model_is_rejected(world1):
    with pytest.raises(RuntimeError, match="no parameter with requires_grad=True"):
        lockstep.DistributedDataParallel(_mlp().requires_grad_(False))


def test_register_comm_hook_twice_is_an_error(world1):
    from lockstep.ddp.comm_hooks import allreduce_hook

    model = lockstep.DistributedDataParallel(_mlp())
    model.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="only once"):
        model.register_comm_hook(None, allreduce_hook)


# ---- GPU variants (skipped without CUDA) ---------------------------------------------------------
def _gpu_scenarios(rank: int) -> dict:
    info = lockstep.init_distributed(device=f"cuda:{rank}")
    assert info.backend == "nccl" and info.device.type == "cuda"
    torch.manual_seed(0)
    model = _mlp().to(info.device)
    reference = copy.deepcopy(model)
    ddp = lockstep.DistributedDataParallel(model, device_ids=[info.local_rank], bucket_cap_mb=0.001)
    world = dist.get_world_size()
    for step in range(STEPS):
        xs, ys = _batches("mlp", step, world)
        for p in (*model.parameters(), *reference.parameters()):
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(ddp(xs[rank]).float(), ys[rank].to(info.device))
        loss.backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = sum(F.mse_loss(reference(xs[r].to(info.device)).float(), ys[r].to(info.device))
                      for r in range(world)) / world
        ref.backward()
        diff = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(model.parameters(), reference.parameters()))
    return {"grad_diff": diff}


@pytest.mark.gpu
def test_gpu_nccl_matches_reference():
    world = min(torch.cuda.device_count(), 2)
    for result in lockstep.spawn(_gpu_scenarios, world, timeout=120):
        assert result["grad_diff"] < 1e-2, result


def test_model_split_over_devices_is_rejected(world1):
    model = _mlp()
    model[4].to("meta")  # any second device: lockstep's DDP drives one device per process
    with pytest.raises(ValueError, match=r"parameter '4.weight' is on meta but '0.weight' is on cpu"):
        lockstep.DistributedDataParallel(model)


def test_several_device_ids_are_rejected(world1):
    with pytest.raises(ValueError, match=r"device_ids=\['cpu', 'cpu'\]: lockstep's DDP drives one device"):
        lockstep.DistributedDataParallel(_mlp(), device_ids=["cpu", "cpu"])


class _PerRankHead(torch.nn.Module):
    """Initialised differently on each rank; a buffer counts forwards from the rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(dist.get_rank())
        self.a, self.head, self.bn = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(4)
        self.register_buffer("count", torch.full((1,), float(dist.get_rank())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.head(self.bn(self.a(x)))


def _ignore_worker(rank: int) -> list[float]:
    lockstep.init_distributed()
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    ignore = ["head.weight", "head.bias", "count", "bn.running_mean"]

    def run(cls, setter) -> torch.Tensor:
        model = _PerRankHead()
        setter(model, ignore)
        wrapped = cls(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7 * step + rank))
            wrapped(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([t.detach().flatten() for t in [*model.parameters(), *model.buffers()]
                          if t.is_floating_point()])

    theirs = run(TorchDDP, TorchDDP._set_params_and_buffers_to_ignore_for_model)
    ours = run(lockstep.DistributedDataParallel,
               lockstep.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)
    mixed = run(lockstep.DistributedDataParallel, TorchDDP._set_params_and_buffers_to_ignore_for_model)
    return [(theirs - ours).abs().max().item(), (theirs - mixed).abs().max().item()]


@pytest.mark.multirank
def test_params_and_buffers_to_ignore_are_left_alone_like_torch():
    """torch's _set_params_and_buffers_to_ignore_for_model: the named parameters keep their own
    values and gradients on each rank, the named buffers are never broadcast; bitwise torch's,
    whichever class set the names."""
    assert lockstep.spawn(_ignore_worker, 2, timeout=120) == [[0.0, 0.0], [0.0, 0.0]]


class _Checkpointed(torch.nn.Module):
    """Reentrant activation checkpointing: the classic reason for static_graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(self.a, x, use_reentrant=True))


def _static_graph_worker(rank: int) -> list[Any]:
    lockstep.init_distributed()
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    def run(cls) -> torch.Tensor:
        model = cls(_Checkpointed())
        model._set_static_graph()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7 * step + rank), requires_grad=True)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    out: list[Any] = [(run(TorchDDP) - run(lockstep.DistributedDataParallel)).abs().max().item()]
    model = lockstep.DistributedDataParallel(_Checkpointed())
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    try:
        model._set_static_graph()
    except RuntimeError as exc:
        out.append(str(exc))
    return out


@pytest.mark.multirank
def test_set_static_graph_after_construction_like_torch():
    """torch's _set_static_graph(), called after wrapping: trains reentrant activation
    checkpointing as torch does; after the first forward it is refused."""
    for diff, refused in lockstep.spawn(_static_graph_worker, 2, timeout=120):
        assert diff == 0.0
        assert "must be called before the first forward" in refused
