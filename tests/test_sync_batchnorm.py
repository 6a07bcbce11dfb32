"""SyncBatchNorm equals BatchNorm over the whole batch: outputs, gradients, running stats."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.sync_batchnorm import SyncBatchNorm

C = 4


def _global_batch(sizes: list[int], step: int, spatial: tuple[int, ...]) -> tuple:
    gen = torch.Generator().manual_seed(10 + step)
    n = sum(sizes)
    x = torch.randn(n, C, *spatial, generator=gen) * 3 + 5  # a large mean tests cancellation
    grad_y = torch.randn(n, C, *spatial, generator=gen)
    return x, grad_y


def _reference_bn(spatial: tuple[int, ...], momentum: float | None) -> torch.nn.Module:
    cls = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d}[len(spatial)]
    bn = cls(C, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, C))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, C))
    return bn


def _compare(sizes: list[int], rank: int, spatial: tuple[int, ...], momentum=0.1) -> dict:
    """Train both for 3 steps on the same data; return the worst difference of each kind."""
    reference = _reference_bn(spatial, momentum)
    sync = SyncBatchNorm.convert_sync_batchnorm(_reference_bn(spatial, momentum))
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    worst = {"output": 0.0, "grad_input": 0.0, "grad_weight": 0.0, "running": 0.0}
    for step in range(3):
        x, grad_y = _global_batch(sizes, step, spatial)
        x_full = x.clone().requires_grad_()
        y_full = reference(x_full)
        y_full.backward(grad_y)
        x_mine = x[start:stop].clone().requires_grad_()
        y_mine = sync(x_mine)
        y_mine.backward(grad_y[start:stop])
        grads = torch.cat([sync.weight.grad, sync.bias.grad])
        if dist.is_initialized():
            dist.all_reduce(grads)  # local sums add up to the whole batch's gradient
        worst["output"] = max(worst["output"], _diff(y_mine, y_full[start:stop]))
        worst["grad_input"] = max(worst["grad_input"], _diff(x_mine.grad, x_full.grad[start:stop]))
        full_grads = torch.cat([reference.weight.grad, reference.bias.grad])
        worst["grad_weight"] = max(worst["grad_weight"], _diff(grads, full_grads))
        for module in (reference, sync):
            module.zero_grad()
    worst["running"] = max(
        _diff(sync.running_mean, reference.running_mean),
        _diff(sync.running_var, reference.running_var),
    )
    sync.eval(), reference.eval()
    x, _ = _global_batch(sizes, 99, spatial)
    with torch.no_grad():
        worst["eval"] = _diff(sync(x[start:stop]), reference(x)[start:stop])
    worst["batches"] = int(sync.num_batches_tracked) - int(reference.num_batches_tracked)
    return worst


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0  # an empty rank has nothing to differ


def _check(worst: dict) -> None:
    for kind in ("output", "grad_input", "grad_weight", "running", "eval"):
        assert worst[kind] < 1e-4, (kind, worst)
    assert worst["batches"] == 0


# ---- one process, no communication --------------------------------------------------------
@pytest.mark.parametrize("spatial, momentum", [((), 0.1), ((5,), None), ((3, 2), 0.3)])
def test_world_of_one_equals_batchnorm(spatial, momentum):
    _check(_compare([6], 0, spatial, momentum))


def test_convert_keeps_state_and_structure():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, C, 3), torch.nn.BatchNorm2d(C),
        torch.nn.Sequential(torch.nn.BatchNorm1d(2)),
    )
    model[1].running_mean.fill_(0.5)
    model.eval()
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    assert type(model[1]) is SyncBatchNorm and type(model[2][0]) is SyncBatchNorm
    assert torch.equal(model[1].running_mean, torch.full((C,), 0.5))
    assert not model[1].training
    assert set(model.state_dict()) == set(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, C, 3), torch.nn.BatchNorm2d(C),
            torch.nn.Sequential(torch.nn.BatchNorm1d(2)),
        ).state_dict()
    )
    bare = torch.nn.BatchNorm1d(3)
    assert isinstance(SyncBatchNorm.convert_sync_batchnorm(bare), SyncBatchNorm)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((C,), r"expects an input of shape \(N, C, \.\.\.\), got 1-D"),
        ((2, C + 1), f"built for {C} channels, but the input has {C + 1}"),
        ((1, C), "more than 1 value per channel"),  # torch's own message in a world of one
        ((2, 0), "number of input channels should be non-zero"),  # torch's, not a ZeroDivisionError
    ],
)
def test_errors_name_the_shape(shape, message):
    with pytest.raises(ValueError, match=message):
        SyncBatchNorm(shape[-1] if len(shape) > 1 and shape[1] == 0 else C)(torch.randn(shape))


def test_world_of_one_is_torchs_batch_norm_and_differentiates_twice():
    # A gradient penalty goes through BatchNorm twice; torch's class falls back to batch_norm
    # with no one to talk to, and so does this one (it raised "differentiate twice" before).
    def penalty(norm: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv1d(3, 3, 1), norm, torch.nn.Tanh(),
                                    torch.nn.Conv1d(3, 1, 1))
        x = torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        return model[0].weight.grad

    assert torch.equal(penalty(SyncBatchNorm(3)), penalty(torch.nn.SyncBatchNorm(3)))
    empty = SyncBatchNorm(3)(torch.randn(0, 3, 2))  # an empty batch: torch's empty output
    assert empty.shape == (0, 3, 2)


def test_bf16_input_keeps_dtype_and_matches_float32():
    x = torch.randn(8, C, 3)
    bn = SyncBatchNorm(C)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bn(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), SyncBatchNorm(C)(x.bfloat16().float()), atol=2e-2)


# ---- several ranks ------------------------------------------------------------------------
def _worker(rank: int, sizes: list[int]) -> tuple[list[dict], float, float]:
    lockstep.init_distributed()
    return ([_compare(sizes, rank, spatial) for spatial in ((), (3, 2))],
            _large_mean_float64(sizes, rank), _converted_again_to_own_group(rank))


def _large_mean_float64(sizes: list[int], rank: int) -> float:
    """float64 values around 1e8: the ranks' statistics must not cancel the variance away."""
    x = torch.randn(sum(sizes), C, 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3)) + 1e8
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    reference = torch.nn.BatchNorm1d(C, dtype=torch.float64)(x)[start:stop]
    return _diff(SyncBatchNorm(C, dtype=torch.float64)(x[start:stop]), reference)


def _converted_again_to_own_group(rank: int) -> float:
    """convert_sync_batchnorm(.., group) moves an existing SyncBatchNorm to that group, as torch."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    model = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(C)))
    model = SyncBatchNorm.convert_sync_batchnorm(model, process_group=groups[rank])
    assert model[0].process_group is groups[rank]
    x = torch.randn(5, C, generator=torch.Generator().manual_seed(rank))
    return _diff(model(x), torch.nn.BatchNorm1d(C)(x))  # alone in its group: local statistics


@pytest.mark.multirank
@pytest.mark.parametrize("sizes", [[1, 4], [3, 0, 4]], ids=["world2", "world3-empty-rank"])
def test_equals_whole_batch_batchnorm(sizes):
    for per_rank, large_mean, regrouped in lockstep.spawn(_worker, len(sizes), args=(sizes,), timeout=120):
        for worst in per_rank:
            _check(worst)
        assert large_mean < 1e-6  # 976 before: E[x^2] - mean^2 in float64
        assert regrouped < 1e-6


def _rank0_evaluates_alone(rank: int) -> bool:
    lockstep.init_distributed()
    bn = SyncBatchNorm(3, track_running_stats=False).eval()
    if rank == 0:  # batch statistics, computed locally: must not wait for rank 1
        out = bn(torch.randn(4, 3))
        return bool(torch.isfinite(out).all())
    return True


def test_eval_without_running_stats_stays_local():
    assert lockstep.spawn(_rank0_evaluates_alone, 2, timeout=60) == [True, True]


def test_bias_false_converts_and_loads_torchs_state():
    """torch 2.13's BatchNorm(bias=False): a weight without a bias, as torch's SyncBatchNorm."""
    source = torch.nn.BatchNorm1d(C, bias=False)
    converted = SyncBatchNorm.convert_sync_batchnorm(source)
    assert converted.bias is None and converted.weight is source.weight
    built = SyncBatchNorm(C, bias=False)
    built.load_state_dict(torch.nn.SyncBatchNorm(C, bias=False).state_dict())
    assert sorted(built.state_dict()) == sorted(torch.nn.SyncBatchNorm(C, bias=False).state_dict())


def _disagreements(rank: int) -> dict:
    lockstep.init_distributed()
    found = {}
    # bias=False over two ranks equals BatchNorm(bias=False) over the whole batch.
    x = torch.randn(8, C, generator=torch.Generator().manual_seed(5), requires_grad=True)
    reference = torch.nn.BatchNorm1d(C, bias=False)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(6))
    layer = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    out = layer(x[rank * 4 : rank * 4 + 4])
    out.square().sum().backward()
    expected = reference(x)
    expected[rank * 4 : rank * 4 + 4].square().sum().backward()
    found["bias_false"] = _diff(out, expected[rank * 4 : rank * 4 + 4])
    found["bias_false_grad"] = _diff(layer.weight.grad, reference.weight.grad)
    # An input that needs no gradient: the backward sends nothing (as torch's), and the weight's
    # gradient is still its slice's.
    import lockstep.sync_batchnorm as module

    sent, reduce = [], module._all_reduce
    module._all_reduce = lambda t, g: (sent.append(t.numel()), reduce(t, g))
    layer.weight.grad = reference.weight.grad = None
    layer(x.detach()[rank * 4 : rank * 4 + 4]).square().sum().backward()
    reference(x.detach())[rank * 4 : rank * 4 + 4].square().sum().backward()
    module._all_reduce = reduce
    found["frozen_input_sent"] = len(sent)
    found["frozen_input_grad"] = _diff(layer.weight.grad, reference.weight.grad)
    # A float64 input for a float32 layer is refused, as BatchNorm refuses it at any world size.
    try:
        SyncBatchNorm(C)(torch.randn(4, C, dtype=torch.float64))
    except RuntimeError as err:
        found["mixed"] = str(err)
    # Ranks that built the layer for different channel counts are told so, on every rank.
    try:
        SyncBatchNorm(C + rank)(torch.randn(4, C + rank))
    except ValueError as err:
        found["channels"] = str(err)
    return found


def test_disagreeing_ranks_and_bias_false_over_two_ranks():
    for found in lockstep.spawn(_disagreements, 2, timeout=120):
        # Each rank's weight gradient is its own slice's loss's, as the reference's.
        assert found["bias_false"] < 1e-5 and found["bias_false_grad"] < 1e-5
        assert found["frozen_input_sent"] == 0 and found["frozen_input_grad"] < 1e-5
        assert "mixed dtype" in found["mixed"] and "torch.float64" in found["mixed"]
        assert f"rank 0: {C}, rank 1: {C + 1}" in found["channels"]
