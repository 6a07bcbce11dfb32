"""lockstep's DistributedDataParallel against torch's own, case by case, in one gloo world of 2.

Every scenario builds the same model twice, wraps one copy in torch's
``torch.nn.parallel.DistributedDataParallel`` and the other in lockstep's, drives both the same
way and records what each did; the tests then compare. Where torch cannot run the case on CPU
(mixed precision needs CUDA streams there) the reference is computed by hand.
"""

from __future__ import annotations

import ast
import copy
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep

pytestmark = pytest.mark.multirank


# ---- models ------------------------------------------------------------------------------
def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _bn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


class Reassigns(nn.Module):
    """Rank 0 replaces its buffer with a new tensor in every forward (not an in-place update)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        if dist.get_rank() == 0:
            self.count = self.count + 1
        return self.lin(x)


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _data(step: int, rank: int, n_in: int = 6, n_out: int = 3):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, n_in, generator=g), torch.randn(4, n_out, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _outcome(fn: Callable[[], Any]) -> Any:
    """What ``fn`` did: ("ok", value) or ("raised", exception class names, message, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - the exception is the result
            return ("raised", [c.__name__ for c in type(exc).__mro__], str(exc),
                    [w.category.__name__ for w in caught])
    return ("ok", value, [w.category.__name__ for w in caught])


def _both(build: Callable[[], nn.Module], **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(torch DDP, lockstep DDP) around two identical copies of ``build()``."""
    return TorchDDP(build(), **kwargs), lockstep.DistributedDataParallel(build(), **kwargs)


def _train(ddp: nn.Module, steps: int = 2, n_in: int = 6, n_out: int = 3) -> list:
    rank = dist.get_rank()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        x, y = _data(step, rank, n_in, n_out)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return _grads(ddp.module) + _state(ddp.module)


# ---- scenarios (each returns a dict of torch's and lockstep's results) --------------------
def _new_arguments() -> dict:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # init_sync=False: nothing is broadcast, each rank keeps its own initial weights.
    for name, cls in (("torch", TorchDDP), ("lockstep", lockstep.DistributedDataParallel)):
        ddp = cls(_mlp(seed=rank), init_sync=False)
        out[f"init_sync_{name}"] = _state(ddp.module)
    # device_mesh: the group of a 1-D mesh; training equals torch's.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t, ours = _both(_mlp, device_mesh=mesh)
    out["mesh_group_same"] = ours.process_group is t.process_group
    out["mesh_train"] = (_train(t), _train(ours))
    out["mesh_and_group"] = [
        _outcome(lambda c=cls: c(_mlp(), device_mesh=mesh, process_group=dist.group.WORLD))[:2]
        for cls in (TorchDDP, lockstep.DistributedDataParallel)]
    # Arguments that change nothing in the results: gradients equal torch's.
    for key, kwargs in {
        "skip_unused": {"find_unused_parameters": True, "skip_all_reduce_unused_params": True},
        "batched_copy": {"batched_grad_copy": True},
        "cap_list": {"bucket_cap_mb_list": [1, 5]},
        "forward_sync_false": {"forward_sync_buffers": False},
    }.items():
        t, ours = _both(Unused if key == "skip_unused" else _mlp, **kwargs)
        out[key] = (_train(t), _train(ours))
    out["check_reduction"] = [
        _outcome(lambda c=cls: c(_mlp(), check_reduction=True) and None)
        for cls in (TorchDDP, lockstep.DistributedDataParallel)]
    return out


def _buffers() -> dict:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for key, kwargs in {"default": {}, "broadcast_false": {"broadcast_buffers": False},
                        "forward_sync_false": {"forward_sync_buffers": False}}.items():
        pair = []
        for cls in (TorchDDP, lockstep.DistributedDataParallel):
            model = _bn()
            model[1].running_mean.fill_(float(rank))  # differs per rank before wrapping
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = cls(model, **kwargs)
            at_init = model[1].running_mean.clone()
            x, _ = _data(0, rank, 5, 2)
            ddp(x)
            pair.append((at_init, model[1].running_mean.clone(), ddp.broadcast_buffers,
                         ddp.will_sync_module_buffers()))
        out[key] = pair
    # A buffer reassigned in forward on rank 0 is still the one broadcast.
    pair = []
    for cls in (TorchDDP, lockstep.DistributedDataParallel):
        model = Reassigns()
        ddp = cls(model)
        for _ in range(3):
            ddp(torch.randn(2, 3))
        pair.append(model.count.item())
    out["reassigned"] = pair
    # torch's rule: the forward after a no_sync forward does not broadcast buffers.
    pair = []
    for cls in (TorchDDP, lockstep.DistributedDataParallel):
        model = _bn()
        ddp, seen = cls(model), []
        for step, sync in enumerate([True, False, False, True, True]):
            x, y = _data(step, rank, 5, 2)
            with (contextlib_nullcontext() if sync else ddp.no_sync()):
                F.mse_loss(ddp(x), y).backward()
            seen.append((model[1].running_mean.clone(), ddp.will_sync_module_buffers()))
        pair.append(seen)
    out["no_sync_buffers"] = pair
    # Buffers of another shape on one rank: a clear error on every rank, no crash.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    if rank == 1:
        model[1].register_buffer("running_mean", torch.zeros(5))
    out["buffer_shapes"] = _outcome(lambda: lockstep.DistributedDataParallel(model))[:3]
    return out


def contextlib_nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _returns_int(state, bucket):
    return 5


def _hooks() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out: dict[str, Any] = {}
    for name, cls in (("torch", TorchDDP), ("lockstep", lockstep.DistributedDataParallel)):
        ddp = cls(_mlp())
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        out[f"twice_{name}"] = _outcome(
            lambda d=ddp: d.register_comm_hook(None, default_hooks.allreduce_hook))[:2]
        ddp = cls(_mlp())
        _train(ddp, steps=1)
        out[f"after_training_{name}"] = _outcome(
            lambda d=ddp: d.register_comm_hook(None, default_hooks.allreduce_hook))[:2]
        out[f"after_training_grads_{name}"] = _train(ddp, steps=1)
        ddp = cls(_mlp())
        ddp.register_comm_hook(None, _returns_int)
        out[f"not_a_future_{name}"] = _outcome(lambda d=ddp: _train(d, steps=1))[:3]
        ddp = cls(_mlp())
        ddp.register_comm_hook(None, _buggy_hook)
        out[f"own_error_{name}"] = _outcome(lambda d=ddp: _train(d, steps=1))[:3]
    return out


def _buggy_hook(state, bucket):  # unannotated: torch checks annotations as objects
    raise ValueError("bug in my hook")


def _mismatch() -> dict:
    rank = dist.get_rank()
    ddp = _outcome(lambda: lockstep.DistributedDataParallel(nn.Linear(3, 3 + rank)))
    zero = _outcome(lambda: lockstep.ZeroRedundancyOptimizer(
        nn.Linear(3, 3 + rank).parameters(), torch.optim.SGD, lr=0.1))
    frozen = _mlp()
    frozen[2].weight.requires_grad_(rank == 0)  # rank 1 froze a layer rank 0 trains
    return {"ddp": ddp[:3], "zero": zero[:3],
            "frozen": _outcome(lambda: lockstep.DistributedDataParallel(frozen))[:3]}


def _copies() -> dict:
    out: dict[str, Any] = {}
    for name, cls in (("torch", TorchDDP), ("lockstep", lockstep.DistributedDataParallel)):
        ddp = cls(_bn())
        _train(ddp, steps=1, n_in=5, n_out=2)
        pickled = pickle.loads(pickle.dumps(ddp))
        deep = copy.deepcopy(ddp)
        out[name] = (type(pickled).__name__, _train(pickled, n_in=5, n_out=2),
                     _train(deep, n_in=5, n_out=2), _train(ddp, n_in=5, n_out=2))
        group = dist.new_group([0, 1])
        other = cls(_mlp(), process_group=group)
        out[f"{name}_group"] = _outcome(lambda o=other: pickle.dumps(o))[:2]
    return out


def _state_dicts() -> dict:
    t, ours = _both(_bn)
    _train(ours, steps=1, n_in=5, n_out=2)
    out = {"keys": (sorted(t.state_dict()), sorted(ours.state_dict()),
                    sorted(ours.state_dict(prefix="module.")))}
    # lockstep -> torch DDP, in one line each way; torch DDP -> lockstep as is.
    t.load_state_dict(ours.state_dict(prefix="module."))
    out["into_torch"] = all(torch.equal(a, b) for a, b in zip(_state(t.module), _state(ours.module)))
    t.module.load_state_dict(ours.state_dict())
    bare = _bn(seed=3)
    bare.load_state_dict(ours.state_dict())
    out["into_bare"] = all(torch.equal(a, b) for a, b in zip(_state(bare), _state(ours.module)))
    _train(t, steps=1, n_in=5, n_out=2)
    ours.load_state_dict(t.state_dict())
    out["from_torch"] = all(torch.equal(a, b) for a, b in zip(_state(t.module), _state(ours.module)))
    # A model whose only child is named `module` (an EMA or teacher wrapper): its own keys
    # start with "module." and must not lose it; torch DDP's keys still lose one.
    t, ours = _both(lambda: _Holder(_bn()))
    _train(t, steps=1, n_in=5, n_out=2)
    out["module_child"] = [_outcome(lambda sd=sd: ours.load_state_dict(sd))[0]
                           for sd in (ours.state_dict(), t.state_dict(), t.module.state_dict())]
    out["module_child_equal"] = all(torch.equal(a, b) for a, b in zip(_state(t.module), _state(ours.module)))
    return out


class _Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _members() -> dict:
    out: dict[str, Any] = {}
    for name, cls in (("torch", TorchDDP), ("lockstep", lockstep.DistributedDataParallel)):
        ddp = cls(_mlp())
        moved = ddp.to_kwargs((torch.ones(2),), {"k": torch.zeros(1)}, 0)
        out[name] = (ddp.join_device, ddp.join_process_group is dist.group.WORLD,
                     ddp.will_sync_module_buffers(), ddp.broadcast_buffers,
                     type(moved).__name__, len(moved[0]), sorted(moved[1][0]))
    ours = lockstep.DistributedDataParallel(_mlp(), dim=0)
    pieces, _ = ours.scatter((torch.arange(6.0),), {}, ["cpu", "cpu"])
    out["scatter_gather"] = (len(pieces), ours.gather([p[0] for p in pieces], "cpu").tolist())
    return out


def _generic_join() -> dict:
    from torch.distributed.algorithms.join import Join

    rank = dist.get_rank()
    out = {}
    for divide in (True, False):
        pair = []
        for cls in (TorchDDP, lockstep.DistributedDataParallel):
            ddp = cls(_bn())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            with Join([ddp], divide_by_initial_world_size=divide):
                for step in range(3 if rank == 0 else 1):
                    opt.zero_grad()
                    x, y = _data(step, rank, 5, 2)
                    F.mse_loss(ddp(x), y).backward()
                    opt.step()
            pair.append(_state(ddp.module))
        out[divide] = pair

    def uneven(cls: Any) -> None:
        ddp = cls(_mlp())
        with Join([ddp], throw_on_early_termination=True):
            for step in range(3 if rank == 0 else 1):
                x, y = _data(step, rank)
                F.mse_loss(ddp(x), y).backward()

    out["throw"] = [_outcome(lambda c=cls: uneven(c))[:2]
                    for cls in (TorchDDP, lockstep.DistributedDataParallel)]
    buffers = []  # even inputs under Join: buffers come from the highest active rank, as torch's
    for cls in (TorchDDP, lockstep.DistributedDataParallel):
        ddp = cls(_bn())
        with Join([ddp]):
            for step in range(2):
                x, y = _data(step, rank, 5, 2)
                F.mse_loss(ddp(x), y).backward()
        buffers.append([b.clone() for b in ddp.module.buffers()])
    out["even_buffers"] = buffers
    return out


def _mixed_precision() -> dict:
    from torch.nn.parallel.distributed import _MixedPrecision

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    ddp = lockstep.DistributedDataParallel(_mlp(), mixed_precision=_MixedPrecision(
        reduce_dtype=torch.float16))
    x, y = _data(0, rank)
    F.mse_loss(ddp(x), y).backward()
    # Reference: torch's order, sum in float16 then divide in float16, back to float32.
    local = _mlp()
    F.mse_loss(local(x), y).backward()
    expected = []
    for p in local.parameters():
        wire = p.grad.half()
        dist.all_reduce(wire)
        expected.append(wire.div_(dist.get_world_size()).float())
    out["reduce_dtype"] = (_grads(ddp.module), expected)
    out["param_dtype"] = _outcome(lambda: lockstep.DistributedDataParallel(
        _mlp(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)))[:3]
    return out


def _delayed() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    reference = _mlp()
    delayed = [(n, p) for n, p in model.named_parameters() if n.startswith("2.")]
    ddp = lockstep.DistributedDataParallel(model, delay_all_reduce_named_params=delayed,
                                           param_to_hook_all_reduce=model[0].weight)
    for step in range(2):
        model.zero_grad()
        reference.zero_grad()
        x, y = _data(step, rank)
        F.mse_loss(ddp(x), y).backward()
        (sum(F.mse_loss(reference(_data(step, r)[0]), _data(step, r)[1]) for r in range(world))
         / world).backward()
    diff = max((a.grad - b.grad).abs().max().item()
               for a, b in zip(model.parameters(), reference.parameters()))
    only_one = _outcome(lambda: lockstep.DistributedDataParallel(
        _mlp(), delay_all_reduce_named_params=delayed))[:3]
    return {"diff": diff, "only_one": only_one}


SCENARIOS: dict[str, Callable[[], dict]] = {
    "new_arguments": _new_arguments,
    "buffers": _buffers,
    "hooks": _hooks,
    "mismatch": _mismatch,
    "copies": _copies,
    "state_dicts": _state_dicts,
    "members": _members,
    "generic_join": _generic_join,
    "mixed_precision": _mixed_precision,
    "delayed": _delayed,
}


def _world2(rank: int) -> dict:
    """Run every scenario; one that raises on every rank fails only its own tests."""
    import traceback

    lockstep.init_distributed()
    out: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            out[name] = scenario()
        except Exception:  # noqa: BLE001 - reported by the tests that read this scenario
            out[name] = {"scenario failed": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    results = lockstep.spawn(_world2, 2, timeout=180)
    for rank, result in enumerate(results):
        for name, value in result.items():
            if isinstance(value, dict) and "scenario failed" in value:
                result[name] = _Failed(rank, name, value["scenario failed"])
    return results


class _Failed(dict):
    """Stands for a scenario that raised: any read fails the test with the traceback."""

    def __init__(self, rank: int, name: str, trace: str) -> None:
        super().__init__()
        self.message = f"scenario {name} raised on rank {rank}:\n{trace}"

    def __getitem__(self, key: Any) -> Any:
        pytest.fail(self.message)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- 1. torch 2.13's constructor arguments -------------------------------------------------
def test_init_sync_false_skips_the_initial_broadcast_like_torch(world2):
    for rank, r in enumerate(world2):
        out = r["new_arguments"]
        assert _equal(out["init_sync_torch"], out["init_sync_lockstep"])
        assert _equal(out["init_sync_lockstep"], _state(_mlp(seed=rank)))


def test_device_mesh_gives_the_group_and_trains_like_torch(world2):
    for r in world2:
        out = r["new_arguments"]
        assert out["mesh_group_same"] and _equal(*out["mesh_train"])
        (torch_kind, _), (our_kind, our_classes) = out["mesh_and_group"]
        assert torch_kind == our_kind == "raised" and "RuntimeError" in our_classes


@pytest.mark.parametrize("case", ["skip_unused", "batched_copy", "cap_list", "forward_sync_false"])
def test_arguments_that_keep_results_train_exactly_like_torch(world2, case):
    for r in world2:
        assert _equal(*r["new_arguments"][case]), case


def test_check_reduction_is_deprecated_like_torch(world2):
    for r in world2:
        (t_kind, _, t_warn), (o_kind, _, o_warn) = r["new_arguments"]["check_reduction"]
        assert t_kind == o_kind == "ok" and "FutureWarning" in t_warn and "FutureWarning" in o_warn


def test_mixed_precision_reduce_dtype_matches_torchs_order(world2):
    for r in world2:
        out = r["mixed_precision"]
        assert _equal(*out["reduce_dtype"])
        kind, classes, message = out["param_dtype"]
        assert kind == "raised" and "ValueError" in classes and "torch.autocast" in message


def test_delay_all_reduce_named_params_averages_them(world2):
    for r in world2:
        assert r["delayed"]["diff"] < 1e-6
        kind, classes, message = r["delayed"]["only_one"]
        assert kind == "raised" and "ValueError" in classes and "go together" in message


# ---- 2. public members --------------------------------------------------------------------
def test_joinable_members_and_to_kwargs_match_torch(world2):
    for r in world2:
        assert r["members"]["torch"] == r["members"]["lockstep"]
        assert r["members"]["scatter_gather"] == (2, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])


@pytest.mark.parametrize("divide", [True, False])
def test_torch_generic_join_trains_like_torch(world2, divide):
    for r in world2:
        torch_state, our_state = r["generic_join"][divide]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(torch_state, our_state))


def test_torch_generic_join_throws_on_early_termination_like_torch(world2):
    for r in world2:
        (t_kind, t_classes), (o_kind, o_classes) = r["generic_join"]["throw"]
        assert t_kind == o_kind == "raised" and t_classes == o_classes


def test_torch_generic_join_takes_buffers_from_the_same_rank_as_torch(world2):
    for r in world2:
        assert _equal(*r["generic_join"]["even_buffers"])


# ---- 3. buffers ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["default", "broadcast_false", "forward_sync_false"])
def test_buffer_sync_at_construction_and_forward_matches_torch(world2, case):
    for r in world2:
        assert _equal(*r["buffers"][case]), case


def test_reassigned_buffer_is_still_broadcast_like_torch(world2):
    assert [r["buffers"]["reassigned"] for r in world2] == [[3.0, 3.0], [2.0, 2.0]]


def test_no_sync_forward_skips_the_next_buffer_broadcast_like_torch(world2):
    for r in world2:
        assert _equal(*r["buffers"]["no_sync_buffers"])


def test_buffers_of_another_shape_are_a_clear_error_on_every_rank(world2):
    for r in world2:
        kind, classes, message = r["buffers"]["buffer_shapes"]
        assert kind == "raised" and "RuntimeError" in classes
        assert "rank 1 holds different buffers than rank 0: buffer '1.running_mean'" in message


# ---- 4. comm hooks ------------------------------------------------------------------------
def test_register_comm_hook_twice_raises_like_torch(world2):
    for r in world2:
        assert r["hooks"]["twice_torch"][:2] == ("raised", r["hooks"]["twice_torch"][1])
        assert r["hooks"]["twice_lockstep"][0] == "raised"
        assert "RuntimeError" in r["hooks"]["twice_lockstep"][1]


def test_register_comm_hook_after_training_is_accepted_like_torch(world2):
    for r in world2:
        assert r["hooks"]["after_training_torch"][0] == r["hooks"]["after_training_lockstep"][0] == "ok"
        assert _equal(r["hooks"]["after_training_grads_torch"],
                      r["hooks"]["after_training_grads_lockstep"])


def test_hook_returning_no_future_is_a_runtime_error_naming_the_hook(world2):
    for r in world2:
        kind, classes, message = r["hooks"]["not_a_future_lockstep"]
        assert r["hooks"]["not_a_future_torch"][0] == kind == "raised"
        assert "RuntimeError" in classes and "_returns_int returned int" in message


def test_a_hooks_own_error_is_raised_as_it_is_like_torch(world2):
    for r in world2:
        for name in ("torch", "lockstep"):
            kind, classes, message = r["hooks"][f"own_error_{name}"]
            assert kind == "raised" and classes[0] == "ValueError" and message == "bug in my hook", (
                name, classes, message)


# ---- 5. ranks that differ -------------------------------------------------------------------
def test_differing_models_raise_runtime_and_value_error_on_every_rank(world2):
    for r in world2:
        for key, text in (("ddp", "rank 1 holds different parameters than rank 0"),
                          ("zero", "rank 1 passed different parameters from rank 0")):
            kind, classes, message = r["mismatch"][key]
            assert kind == "raised" and text in message
            assert {"ReplicaMismatchError", "RuntimeError", "ValueError"} <= set(classes)
        kind, classes, message = r["mismatch"]["frozen"]
        assert kind == "raised" and "ReplicaMismatchError" in classes
        assert "parameter '2.weight' has requires_grad=False, rank 0 has requires_grad=True" in message


# ---- 6. pickle and deepcopy -------------------------------------------------------------------
def test_pickle_and_deepcopy_rebuild_and_train_like_torch(world2):
    for r in world2:
        torch_out, our_out = r["copies"]["torch"], r["copies"]["lockstep"]
        assert our_out[0] == "DistributedDataParallel"
        assert _equal(torch_out[1:], our_out[1:])
        assert r["copies"]["torch_group"][0] == r["copies"]["lockstep_group"][0] == "raised"


# ---- 7. state_dict ------------------------------------------------------------------------
def test_state_dict_loads_both_ways(world2):
    for r in world2:
        torch_keys, our_keys, prefixed = r["state_dicts"]["keys"]
        assert prefixed == torch_keys and [f"module.{k}" for k in our_keys] == torch_keys
        assert r["state_dicts"]["into_torch"] and r["state_dicts"]["into_bare"]
        assert r["state_dicts"]["from_torch"]
        assert r["state_dicts"]["module_child"] == ["ok", "ok", "ok"]
        assert r["state_dicts"]["module_child_equal"]


# ---- 8. bad input, at a world of one --------------------------------------------------------
@pytest.fixture
def world1():
    lockstep.init_distributed()
    yield
    lockstep.shutdown_distributed()


@pytest.mark.parametrize("value, error, text", [
    (-1, ValueError, "bucket_cap_mb=-1 must be a positive"),
    (0, ValueError, "bucket_cap_mb=0 must be a positive"),
    (float("nan"), ValueError, "must be a positive, finite"),
    ("25", TypeError, "bucket_cap_mb must be a number of MiB (int or float), got str '25'"),
])
def test_bucket_cap_is_checked_at_construction_at_world_one(world1, value, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        lockstep.DistributedDataParallel(_mlp(), bucket_cap_mb=value)


def test_bucket_cap_is_checked_before_a_process_group_exists():
    with pytest.raises(TypeError, match="got str"):
        lockstep.DistributedDataParallel(_mlp(), bucket_cap_mb="25")


@pytest.mark.parametrize("thing, text", [
    (lambda x: x, "got the callable"),
    (torch.ones(3), r"got a tensor of shape \[3\]"),
])
def test_wrapping_something_that_is_not_a_module_names_it(thing, text):
    with pytest.raises(TypeError, match=f"wraps a torch.nn.Module, {text}"):
        lockstep.DistributedDataParallel(thing)


def test_cpu_model_with_device_ids_says_device_ids_is_for_cuda(world1):
    with pytest.raises(ValueError, match=r"the model is on the CPU, but device_ids=\[0\] is for "
                       "a model on a CUDA device"):
        lockstep.DistributedDataParallel(_mlp(), device_ids=[0])


# ---- 9. seams -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["lockstep/ddp/join.py", "lockstep/pipeline/ranks.py"])
def test_join_and_pipeline_use_only_public_members(path):
    tree = ast.parse((Path(__file__).resolve().parents[2] / path).read_text())
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and node.attr.startswith("_") and not node.attr.startswith("__")
                      and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "dist"))})
    assert private == [], f"{path} reads private members {private}"


def test_each_allreduce_hook_has_its_own_name():
    import lockstep.comm
    import lockstep.ddp

    assert not hasattr(lockstep.comm, "allreduce_hook")
    assert lockstep.ddp.allreduce_hook.__module__ == "lockstep.comm.hooks"  # its home since the house move
    assert lockstep.comm.uncompressed_hook.__module__ == "lockstep.comm.compression"
