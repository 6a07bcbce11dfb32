"""DataParallel on CPU device lists: equivalence with the bare module, loss mode, cache, errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

# Optimizers import torch._dynamo lazily, and that import sets TORCHINDUCTOR_CACHE_DIR: import it
# here, before conftest's environment-leak check takes its snapshot.
import torch._dynamo
from torch import nn

import lockstep
from lockstep.dp import data_parallel, replica_cache
from lockstep.dp.balance import DeviceCapacity, imbalance_message
from lockstep.dp.data_parallel import DataParallel

CPU2, CPU3 = ["cpu", "cpu"], ["cpu", "cpu", "cpu"]


class TwoHeads(nn.Module):
    """Nested inputs (dict of tensors, keyword scale) and nested outputs (dict holding a tuple)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh())
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 1)

    def forward(self, batch: dict, extra: tuple, *, scale: float, shift: torch.Tensor) -> dict:
        h = self.body(batch["x"] + extra[0])
        return {"logits": self.a(h) * scale + shift, "aux": (self.b(h), extra[1])}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _check_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_is_exported_and_keeps_module():
    model = nn.Linear(2, 2)
    dp = lockstep.DataParallel(model, CPU2)
    assert lockstep.DataParallel is DataParallel and dp.module is model
    assert dp.device_ids == [torch.device("cpu")] * 2 and dp.output_device == torch.device("cpu")


@pytest.mark.parametrize("batch", [7, 2])  # uneven split over 3; a batch smaller than the device count
def test_training_steps_match_the_bare_module(batch):
    torch.manual_seed(0)
    ref = TwoHeads()
    model = copy.deepcopy(ref)
    dp = DataParallel(model, CPU3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x, noise = torch.randn(batch, 5), torch.randn(batch, 5)
        outs = []
        for net, opt_ in ((ref, opt_ref), (dp, opt)):
            opt_.zero_grad()
            out = net({"x": x}, (noise, "tag"), scale=2.0, shift=noise[:, :3])
            (out["logits"].pow(2).mean() + out["aux"][0].sum()).backward()
            opt_.step()
            outs.append(out)
        torch.testing.assert_close(outs[0]["logits"], outs[1]["logits"])
        assert outs[1]["aux"][1] == "tag"
    _check_same(list(ref.parameters()), list(model.parameters()))


def test_dim_selects_the_batch_dimension():
    torch.manual_seed(0)
    gru = nn.GRU(3, 4)  # sequence-first: the batch is dim 1
    x = torch.randn(6, 5, 3)
    out, h = DataParallel(gru, CPU2, dim=1)(x)
    ref_out, ref_h = gru(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(h, ref_h)


def test_batchnorm_normalises_per_replica_and_stats_come_from_the_first():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = copy.deepcopy(ref)
    dp = DataParallel(model, CPU2)
    x = torch.randn(8, 3)
    out = dp(x)
    first = ref(x[:4])
    torch.testing.assert_close(out[:4], first)
    torch.testing.assert_close(out[4:], copy.deepcopy(ref)(x[4:]))
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    assert model[1].num_batches_tracked.item() == 1
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_balanced_loss_equals_full_batch_loss_and_gradients():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    model = copy.deepcopy(ref)
    x, y = torch.randn(7, 6), torch.randint(0, 4, (7,))
    for reduction in ("mean", "sum"):
        ref.zero_grad()
        model.zero_grad()
        criterion = nn.CrossEntropyLoss(reduction=reduction)
        dp = DataParallel(model, CPU3, loss_fn=criterion)
        loss = dp(x, targets=y)
        expected = criterion(ref(x), y)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        _check_same(_grads(ref), _grads(model))


def test_balanced_loss_none_reduction_and_gathered_outputs():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    dp = DataParallel(model, CPU2, loss_fn=nn.MSELoss(reduction="none"), gather_outputs=True)
    loss, out = dp(x, targets=y)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(loss, (model(x) - y) ** 2)
    torch.testing.assert_close(dp(x), model(x))  # without targets: plain outputs


def test_loss_fn_with_a_buffer_is_replicated():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 2, 1, 0])
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]), reduction="sum")
    dp = DataParallel(model, CPU3, loss_fn=criterion)
    torch.testing.assert_close(dp(x, targets=y), criterion(model(x), y))
    assert "loss_fn.weight" not in dp.state_dict() and not any("loss_fn" in k for k in nn.Module.state_dict(dp))


def test_single_device_calls_the_module_directly():
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    torch.testing.assert_close(DataParallel(model, ["cpu"])(x), model(x))
    loss = DataParallel(model, ["cpu"], loss_fn=nn.MSELoss())(x, targets=y)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y))


def test_scalar_output_becomes_a_vector_with_a_warning():
    class LossInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    model = LossInside()
    x = torch.randn(6, 2)
    with pytest.warns(UserWarning, match="one value per replica"):
        out = DataParallel(model, CPU3)(x)
    torch.testing.assert_close(out, torch.stack([model(c) for c in x.chunk(3)]))


def test_inference_replicas_are_cached_and_refreshed_after_a_step(monkeypatch):
    calls = []
    real = replica_cache.replicate
    counting = lambda *a, **k: calls.append(k.get("detach")) or real(*a, **k)
    monkeypatch.setattr(replica_cache, "replicate", counting)
    monkeypatch.setattr(data_parallel, "replicate", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    dp = DataParallel(model, CPU2)
    x = torch.randn(4, 3)
    model.eval()
    with torch.no_grad():
        first, again = dp(x), dp(x)
        torch.testing.assert_close(dp(x[:1]), model(x[:1]))  # a short batch reuses the cache
    assert calls == [True] and torch.equal(first, again)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.train()
    dp(x).sum().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(dp(x), model(x))  # refreshed: the step is visible in replica 1
        model.train()  # the train/eval flag is part of the key too
        dp(x)
    assert calls == [True, False, True, True]  # the training forward replicates with autograd
    model.eval()
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # invisible to version counters: cleared by hand
        dp.clear_replica_cache()
        torch.testing.assert_close(dp(x), model(x))
    assert len(calls) == 5
    dp_nocache = DataParallel(model.eval(), CPU2, cache_replicas=False)
    with torch.no_grad():
        dp_nocache(x), dp_nocache(x)
    assert len(calls) == 7


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.temperature = 1.0

    def forward(self, x):
        return self.lin(x) / self.temperature


def test_cached_replicas_follow_plain_attributes_and_skip_inference_tensors():
    # Found by an outside audit: a cached replica kept the temperature it was made with (rows of
    # the second replica 0.5 off), and a model built under inference_mode crashed the cache.
    model = _Tempered().eval()
    dp = DataParallel(model, CPU2)
    x = torch.randn(4, 3)
    with torch.no_grad():
        dp(x)
        model.temperature = 2.0  # no tensor changed: the cached replicas are reused
        torch.testing.assert_close(dp(x), model(x))
    with torch.inference_mode():
        built = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)).eval()
        torch.testing.assert_close(DataParallel(built, CPU2)(x), built(x))


def test_state_dict_has_no_prefix_and_load_accepts_both():
    torch.manual_seed(0)
    dp = DataParallel(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), CPU2)
    assert list(dp.state_dict()) == list(dp.module.state_dict())
    source = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    dp.load_state_dict(source.state_dict())
    assert torch.equal(dp.module[0].weight, source[0].weight)
    prefixed = {"module." + k: v + 1 for k, v in source.state_dict().items()}
    dp.load_state_dict(prefixed)
    assert torch.equal(dp.module[0].weight, source[0].weight + 1)
    with pytest.raises(RuntimeError, match="Missing key"):
        dp.load_state_dict({"0.weight": source[0].weight})
    parent = nn.ModuleDict({"net": dp})
    parent.load_state_dict(copy.deepcopy(parent.state_dict()))  # nested: saved and loaded alike


def test_replica_error_names_the_device():
    class Picky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.min() < 0:
                raise ValueError("negative input")
            return x

    with pytest.raises(ValueError, match="replica 1 on device cpu raised ValueError: negative input"):
        DataParallel(Picky(), CPU2)(torch.tensor([1.0, -1.0]))


def test_constructor_errors():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="device_ids is empty"):
        DataParallel(lin, [])
    with pytest.raises(ValueError, match=r"device_ids mixes device types \['cpu', 'cuda'\]"):
        DataParallel(lin, ["cpu", "cuda:0"])
    if torch.cuda.is_available():  # (without CUDA, torch's and lockstep's run on the CPU instead)
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=rf"device_ids names cuda:{n + 3} but {n} CUDA device\(s\) are visible"):
            DataParallel(lin, [n + 3])
    with pytest.raises(ValueError, match="drives 'cuda' or 'cpu' devices, not 'meta'"):
        DataParallel(lin, ["meta", "meta"])
    with pytest.raises(ValueError, match="holds something that is not a device"):
        DataParallel(lin, ["gpu0"])
    with pytest.raises(ValueError, match="output_device='meta' is neither the CPU nor a cpu device"):
        DataParallel(lin, CPU2, output_device="meta")
    with pytest.raises(ValueError, match=r"loss_reduction='avg' is not one of \('mean', 'sum', 'none'\)"):
        DataParallel(lin, CPU2, loss_fn=nn.MSELoss(), loss_reduction="avg")


class _Branchy(nn.Module):
    def forward(self, x):
        return x * 2, (x if bool((x > 0).all()) else None)


def test_forward_errors():
    with pytest.raises(ValueError, match=r"parameter 'weight' is on meta but DataParallel needs the module on "
                                         r"device_ids\[0\] = cpu"):
        DataParallel(nn.Linear(2, 2, device="meta"), CPU2)(torch.ones(2, 2))
    dp = DataParallel(nn.Linear(2, 2), CPU2)
    with pytest.raises(ValueError, match=r"inputs\['kwargs'\]\['x'\] is on meta but this DataParallel drives "
                                         r"cpu devices \['cpu', 'cpu'\]; move the input to cpu"):
        dp(x=torch.ones(2, 2, device="meta"))
    # None from one replica and a tensor from another: the same error in either order
    branchy = DataParallel(_Branchy(), CPU2)
    for x in (torch.tensor([[1.0], [1.0], [-1.0], [-1.0]]), torch.tensor([[-1.0], [-1.0], [1.0], [1.0]])):
        with pytest.raises(ValueError, match=r"a tensor and a non-tensor at output\[1\]"):
            branchy(x)
    packed = nn.utils.rnn.pack_padded_sequence(torch.zeros(3, 2, 4), [3, 2], batch_first=False)
    with pytest.raises(ValueError, match="cannot scatter a PackedSequence"):
        DataParallel(nn.LSTM(4, 4), CPU2)(packed)
    dp = DataParallel(nn.Linear(2, 3), CPU2, loss_fn=lambda out, y: out - y)
    with pytest.raises(ValueError, match=r"loss_fn returned \(1, 3\) on replica 0, not a scalar, with "
                                         r"loss_reduction='mean'"):
        dp(torch.ones(2, 2), targets=torch.ones(2, 3))


def test_imbalance_warning_names_the_weak_device_with_numbers():
    big = DeviceCapacity(torch.device("cuda", 0), 80 * 2**30, 132)
    small = DeviceCapacity(torch.device("cuda", 1), 24 * 2**30, 132)
    message = imbalance_message([big, small, big])
    assert message is not None
    assert "cuda:1 has 24.0 GiB (30% of the largest) and 132 multiprocessors (100% of the most)" in message
    assert "cuda:0" not in message
    assert imbalance_message([big, big]) is None and imbalance_message([small]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallel(nn.Linear(2, 2), CPU2)  # CPU lists have nothing to compare: no warning


@pytest.mark.gpu
def test_gpu_training_and_loss_mode_match_the_bare_module():
    devices = list(range(torch.cuda.device_count()))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4)).cuda(0)
    model = copy.deepcopy(ref)
    x, y = torch.randn(2 * len(devices) + 1, 6), torch.randint(0, 4, (2 * len(devices) + 1,))
    dp = DataParallel(model, devices, loss_fn=nn.CrossEntropyLoss(), gather_outputs=True)
    loss, out = dp(x, targets=y)
    assert loss.device == out.device == torch.device("cuda", 0)
    expected = nn.functional.cross_entropy(ref(x.cuda(0)), y.cuda(0))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _check_same(_grads(ref), _grads(model))
    with torch.no_grad():
        torch.testing.assert_close(DataParallel(model, devices, output_device=-1)(x), model(x.cuda(0)).cpu())


@pytest.mark.gpu
def test_balanced_loss_lowers_device0_peak_memory_against_torch():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    devices = list(range(torch.cuda.device_count()))
    model = nn.Linear(256, 32768).cuda(0)  # wide outputs: what piles up on device 0
    x = torch.randn(256 * len(devices), 256, device="cuda:0")
    y = torch.randint(0, 32768, (x.shape[0],), device="cuda:0")

    def peak(step) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(0)
        base = torch.cuda.memory_allocated(0)
        step().backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated(0) - base

    theirs = nn.DataParallel(model, devices)
    ours = DataParallel(model, devices, loss_fn=nn.CrossEntropyLoss())
    torch_peak = peak(lambda: nn.functional.cross_entropy(theirs(x), y))
    our_peak = peak(lambda: ours(x, targets=y))
    assert our_peak < torch_peak, (our_peak, torch_peak)


# --- found by an outside audit (diag/dp7), 2026-11-29 -------------------------------------------


def test_cached_replicas_follow_a_swapped_parameterless_child_and_deleted_attributes():
    class Net(nn.Module):
        scale = 1.0  # the class default, back in force once the instance attribute is deleted

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.lin(x)) * self.scale

    model = Net().eval()
    model.scale = 2.0
    dp = DataParallel(model, CPU2)
    x = torch.randn(6, 4)
    with torch.no_grad():
        dp(x)
        model.act = nn.Tanh().eval()  # no tensor changed, but the structure did
        torch.testing.assert_close(dp(x), model(x))
        del model.scale
        torch.testing.assert_close(dp(x), model(x))


def test_a_holder_of_the_wrapper_gets_torchs_keys_and_loads_them_back():
    # A module holding the wrapper (AveragedModel, a container) gets torch's keys, module.
    # included, as with lockstep's DDP; on its own the wrapper still gives the bare keys.
    class Holder(nn.Module):
        def __init__(self, dp: nn.Module) -> None:
            super().__init__()
            self.dp = dp

    ours = Holder(DataParallel(nn.Linear(3, 2), CPU2))
    theirs = Holder(nn.DataParallel(nn.Linear(3, 2)))
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["dp.module.weight", "dp.module.bias"]
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(theirs.dp.module.weight, ours.dp.module.weight)
    assert list(ours.dp.state_dict()) == ["weight", "bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's old positional arguments
        assert list(ours.dp.state_dict(None, "p.")) == list(theirs.dp.state_dict(None, "p."))


def test_a_forward_that_writes_its_input_in_place_trains_like_the_bare_module():
    # CPU chunks were views of one input sharing its version counter: ReLU(inplace=True) in one
    # replica invalidated what the others saved for backward.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 3))
    model = copy.deepcopy(ref)
    x = torch.randn(7, 4)
    ref(x.clone()).sum().backward()
    DataParallel(model, CPU3)(x.clone()).sum().backward()
    _check_same(_grads(model), _grads(ref))


def test_graph_module_runs_under_the_wrapper():
    import torch.fx

    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2)))
    x = torch.randn(6, 5)
    torch.testing.assert_close(DataParallel(traced, CPU2)(x), traced(x))
    with torch.no_grad():  # the cached replicas too
        dp = DataParallel(traced.eval(), CPU2)
        dp(x)
        torch.testing.assert_close(dp(x), traced(x))


def test_ignore_index_needs_a_sum_and_a_count_as_the_docs_say():
    # docs/dataparallel.md: 'mean' weights replicas by samples, so ignored targets make it
    # inexact (NaN when one replica's targets are all ignored); sum, then divide by the count.
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    y[6:] = -100  # the last replica's chunk is all padding
    want = nn.functional.cross_entropy(net(x), y)
    assert torch.isnan(DataParallel(net, CPU3, loss_fn=nn.CrossEntropyLoss())(x, targets=y))
    summed = DataParallel(net, CPU3, loss_fn=nn.CrossEntropyLoss(reduction="sum"))(x, targets=y)
    torch.testing.assert_close(summed / (y != -100).sum(), want)
