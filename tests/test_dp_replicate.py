"""replicate: copies autograd follows, coalesced per dtype, tied and frozen tensors, buffers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lockstep.dp.replicate import replicate

CPU3 = ["cpu", "cpu", "cpu"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def test_replicas_hold_equal_copies_and_the_first_is_the_module():
    model = _model()
    replicas = replicate(model, CPU3)
    assert replicas[0] is model
    for rep in replicas[1:]:
        assert type(rep) is nn.Sequential and type(rep[0]) is nn.Linear
        for (name, a), b in zip(model.state_dict().items(), rep.state_dict().values()):
            assert torch.equal(a, b), name
            assert a.data_ptr() != b.data_ptr(), f"{name} is shared with the original"


def test_backward_sums_every_replica_gradient_into_the_original():
    model, x = _model().eval(), torch.randn(9, 4)
    replicas = replicate(model, CPU3)
    sum(rep(chunk).pow(2).sum() for rep, chunk in zip(replicas, x.chunk(3))).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).pow(2).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_copies_are_coalesced_one_flat_storage_per_dtype():
    model = _model()
    rep = replicate(model, ["cpu", "cpu"])[1]
    param_storages = {p.untyped_storage().data_ptr() for p in rep.parameters()}
    assert len(param_storages) == 1
    # float running stats share one storage, the int64 counter its own.
    assert len({b.untyped_storage().data_ptr() for b in rep.buffers()}) == 2


def test_buffers_are_private_per_replica_and_only_the_first_updates_the_module():
    model = _model().train()
    a, b = replicate(model, ["cpu", "cpu"])
    before = model[1].running_mean.clone()
    b(torch.randn(4, 4) + 5)
    assert torch.equal(model[1].running_mean, before)
    a(torch.randn(4, 4) + 5)
    assert not torch.equal(model[1].running_mean, before)
    assert b[1].running_mean.data_ptr() != a[1].running_mean.data_ptr()


def test_tied_weights_stay_tied_and_frozen_stay_frozen():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
    model[1].weight = model[0].weight
    model[1].bias.requires_grad_(False)
    rep = replicate(model, ["cpu", "cpu"])[1]
    assert rep[1].weight is rep[0].weight
    assert not rep[1].bias.requires_grad and rep[0].weight.requires_grad


def test_detach_makes_copies_without_autograd():
    rep = replicate(_model(), ["cpu", "cpu"], detach=True)[1]
    assert all(p.grad_fn is None and not p.requires_grad for p in rep.parameters())


def test_errors():
    with pytest.raises(ValueError, match="at least one device"):
        replicate(_model(), [])
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on meta but DataParallel needs the module "
                                         r"on device_ids\[0\] = cpu; call module.to\('cpu'\)"):
        replicate(_model().to("meta"), CPU3)


@pytest.mark.gpu
def test_replicate_across_gpus_sums_gradients():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    model = _model().eval().to(devices[0])
    x = torch.randn(3 * len(devices), 4)
    replicas = replicate(model, devices)
    assert [next(r.parameters()).device for r in replicas] == devices
    total = sum(rep(c.to(d)).pow(2).sum().to(devices[0]) for rep, c, d in zip(replicas, x.chunk(len(devices)), devices))
    total.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x.to(devices[0])).pow(2).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_lstm_replicas_run_on_their_own_weights():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, num_layers=2, batch_first=True)
    x = torch.randn(4, 5, 3)
    replicas = replicate(lstm, ["cpu", "cpu"])
    assert all(a is not b for a, b in zip(replicas[1]._flat_weights, lstm._flat_weights))
    sum(rep(chunk)[0].sum() for rep, chunk in zip(replicas, x.chunk(2))).backward()
    got = [p.grad.clone() for p in lstm.parameters()]
    lstm.zero_grad()
    lstm(x)[0].sum().backward()
    for g, p in zip(got, lstm.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_replicas_list_their_parameters():
    # A common forward idiom that replicas made by torch's DataParallel break (they list none).
    rep = replicate(_model(), ["cpu", "cpu"])[1]
    assert len(list(rep.parameters())) == 6 and next(rep.parameters()).grad_fn is not None


def test_broadcast_sums_mixed_sparse_and_dense_gradients_and_skips_unused_copies():
    from lockstep.dp.broadcast import broadcast_coalesced

    weight = torch.randn(5, 2, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    (w1, u1), (w2, _) = broadcast_coalesced([weight, unused], [torch.device("cpu")] * 2,
                                            share_same_device=True)
    idx = torch.tensor([0, 3])
    sparse_part = torch.nn.functional.embedding(idx, w1, sparse=True).sum()
    (sparse_part + w2.sum() + 0 * u1.sum()).backward()
    expected = torch.ones(5, 2)
    expected[idx] += 1
    torch.testing.assert_close(weight.grad, expected)
    assert not weight.grad.is_sparse  # a dense gradient joined: the sum is dense
    torch.testing.assert_close(unused.grad, torch.zeros(3))


# --- found by an outside audit (diag/dp7), 2026-11-29 -------------------------------------------


class _EMA(nn.Module):
    """A buffer in the graph and another updated in place in forward (VQ-VAE's EMA codebook)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y


class _IndexedBias(nn.Module):
    """timm's LeViT: an int64 index buffer saved for backward, then BatchNorm's counter add_(1)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5))
        self.register_buffer("idx", torch.tensor([0, 1, 2, 3, 4, 3, 2, 1]))
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x) + self.table[self.idx])


@pytest.mark.parametrize("make", [_EMA, _IndexedBias])
def test_in_place_buffer_writes_leave_the_other_buffers_valid_for_backward(make):
    # Replica buffers were views of one flat copy with one version counter, so writing one in
    # place failed backward ("modified by an inplace operation"); torch's copies have their own.
    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, model.lin.in_features)
    replicas = replicate(model, CPU3)
    sum(r(c).sum() for r, c in zip(replicas, x.chunk(3))).backward()
    assert all(p.grad is not None for p in model.parameters())
    bufs = list(replicas[1].buffers())
    before = [b._version for b in bufs]
    bufs[0].add_(1)
    assert [b._version for b in bufs][1:] == before[1:]
    assert not any(b._is_view() for b in bufs)


def test_replica_parameters_are_not_views_and_in_place_renorm_works():
    # nn.Embedding(max_norm=...) renormalises its weight in place; on a view output of the
    # broadcast that raised "Output 0 of _Broadcast is a view ... modified inplace".
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 2))

    idx = torch.randint(0, 20, (9,), generator=torch.Generator().manual_seed(1))
    ref = make()
    ref(idx).sum().backward()
    model = make()
    replicas = replicate(model, CPU3)
    assert not any(p._is_view() for r in replicas[1:] for p in r.parameters())
    # No two replicas share memory, so one replica's in-place write cannot reach another.
    ptrs = {p.data_ptr() for r in replicas for p in r.parameters()}
    assert len(ptrs) == 3 * len(list(model.parameters()))
    sum(r(c).sum() for r, c in zip(replicas, idx.chunk(3))).backward()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_graph_modules_replicate_through_torchs_hook():
    # torch's replicate calls module._replicate_for_data_parallel(), which GraphModule overrides
    # (its class, made per instance, holds the generated forward); type(m).__new__ alone failed.
    import torch.fx

    torch.manual_seed(0)
    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2)))
    ref = copy.deepcopy(traced)
    x = torch.randn(6, 5)
    replicas = replicate(traced, ["cpu", "cpu"])
    out = torch.cat([r(c) for r, c in zip(replicas, x.chunk(2))])
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    for got, want in zip(traced.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_modules_own_replicate_hook_is_called_as_torch_calls_it():
    """A class overriding torch's replicate hook gets it called for each replica (torch's
    replicate does); lockstep ignored such hooks until 2026-11-29."""

    class Counted(nn.Linear):
        def _replicate_for_data_parallel(self):
            replica = super()._replicate_for_data_parallel()
            replica.made_by_hook = True
            return replica

        def forward(self, x):
            return super().forward(x) * (2.0 if getattr(self, "made_by_hook", False) else 1.0)

    torch.manual_seed(0)
    model = Counted(4, 3)
    x = torch.randn(6, 4)
    replicas = replicate(model, ["cpu", "cpu"])
    assert replicas[0] is model  # lockstep's first replica is the module itself (docs)
    assert getattr(replicas[1], "made_by_hook", False)
    torch.testing.assert_close(replicas[1](x), 2 * nn.functional.linear(x, model.weight, model.bias))
