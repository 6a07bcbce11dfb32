"""DataParallel against torch.nn.DataParallel and a single-device reference, case by case.

torch's DataParallel on a machine without GPUs calls the module on the whole batch; lockstep's
runs real replicas in threads on a CPU device list. Where torch's class runs the case on the CPU
it is checked in the same test; the single-device reference is the bare module, run on the whole
batch where the result cannot depend on the split (eval-mode BatchNorm, no randomness) and on each
chunk in turn where it does (train-mode BatchNorm, dropout).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import threading
import warnings
from typing import Any

import pytest
import torch

# Optimizers import torch._dynamo lazily, and that import sets TORCHINDUCTOR_CACHE_DIR: import it
# here, before conftest's environment-leak check takes its snapshot.
import torch._dynamo
from torch import nn
from torch.utils.data import DataLoader

import lockstep
from lockstep.dp import DataParallel
from lockstep.helper import move_to_device
from lockstep.sampler import DistributedSampler

CPU2 = ["cpu", "cpu"]


# --- 1. replicas keep parameters registered as None: torchvision-like ResNet blocks ------------


class BasicBlock(nn.Module):
    """torchvision's ResNet block, re-expressed: bias-free convolutions, BatchNorm, a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + shortcut)


class TinyResNet(nn.Module):
    """A frozen stem, two blocks, and a head whose two projections share (tie) one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.stem[0].weight.requires_grad_(False)  # frozen
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.proj = nn.Linear(16, 16, bias=False)
        self.proj_again = nn.Linear(16, 16, bias=False)
        self.proj_again.weight = self.proj.weight  # tied
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3))
        return self.fc(self.proj_again(torch.relu(self.proj(h))))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_grads_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name, got in a.items():
        assert (got is None) == (b[name] is None), name
        if got is not None:
            torch.testing.assert_close(got, b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_resnet_blocks_with_bias_free_convs_tied_and_frozen_parameters_match_torch_eval():
    torch.manual_seed(0)
    ref = TinyResNet().eval()  # eval BatchNorm: the output cannot depend on the split
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    x = torch.randn(6, 3, 8, 8)
    results = []
    for net in (ref, DataParallel(ours, CPU2), nn.DataParallel(theirs)):
        out = net(x)
        out.pow(2).sum().backward()
        results.append(out)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[2], results[0])
    for model in (ours, theirs):
        _assert_grads_equal(_grads(model), _grads(ref))
    assert ours.stem[0].weight.grad is None and ours.proj.weight is ours.proj_again.weight


def test_resnet_blocks_train_mode_match_the_module_run_chunk_by_chunk():
    torch.manual_seed(0)
    ref = TinyResNet().train()
    model = copy.deepcopy(ref)
    dp = DataParallel(model, CPU2)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        x = torch.randn(6, 3, 8, 8)
        out = dp(x)
        out.pow(2).sum().backward()
        # Reference: chunk 0 through the module (it updates the running statistics, as replica 0
        # does); chunk 1 through the same parameters with a throwaway copy of the buffers.
        first, second = x.chunk(2)
        buffers = {n: b.clone() for n, b in ref.named_buffers()}
        state = {**dict(ref.named_parameters()), **buffers}
        expected = torch.cat([ref(first), torch.func.functional_call(ref, state, (second,))])
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5, msg=f"step {step}")
        _assert_grads_equal(_grads(model), _grads(ref))
        for opt_ in (opt, opt_ref):
            opt_.step()
            opt_.zero_grad()
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


class _NoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self) -> torch.Tensor:
        return self.table * 2


def test_a_forward_without_arguments_runs_once_like_torch():
    ours, theirs = DataParallel(_NoInputs(), device_ids=CPU2), torch.nn.DataParallel(_NoInputs())
    for wrapper in (ours, theirs):
        wrapper().sum().backward()
    assert ours().shape == theirs().shape == (3, 4)  # one call, not one per device concatenated
    assert torch.equal(ours.module.table.grad, theirs.module.table.grad)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_model_whose_child_is_named_module_loads_its_own_state_dict():
    ours = DataParallel(_Holder(), device_ids=CPU2)
    theirs = torch.nn.DataParallel(_Holder())
    for saved in (ours.state_dict(), theirs.state_dict(), _Holder().state_dict()):
        ours.load_state_dict(saved)  # bare keys "module.weight", torch's "module.module.weight"
    assert torch.equal(ours.module.module.weight, theirs.module.module.weight)


def test_buffers_registered_as_none_stay_none_in_replicas():
    class WithNoneBuffer(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 2, bias=False)
            self.register_buffer("offset", None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out if self.offset is None else out + self.offset

    model = WithNoneBuffer()
    x = torch.randn(4, 4)
    replica = lockstep.dp.replicate(model, CPU2)[1]
    assert replica.bias is None and replica.offset is None
    assert list(replica._parameters) == list(model._parameters)
    torch.testing.assert_close(DataParallel(model, CPU2)(x), nn.DataParallel(model)(x))


# --- 2. sparse gradients -----------------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self, sparse_only: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.head = None if sparse_only else nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return h if self.head is None else self.head(h)


@pytest.mark.parametrize("sparse_only", [True, False], ids=["embedding-alone", "beside-dense"])
def test_sparse_gradients_are_summed_and_stay_sparse(sparse_only):
    torch.manual_seed(0)
    ref = Bag(sparse_only)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    idx = torch.tensor([1, 2, 3, 1, 5, 1, 7])  # index 1 in both chunks: values to sum
    for net in (ref, DataParallel(ours, CPU2), nn.DataParallel(theirs)):
        net(idx).pow(2).sum().backward()
    for model in (ours, theirs):
        assert model.emb.weight.grad.is_sparse
        torch.testing.assert_close(model.emb.weight.grad.to_dense(), ref.emb.weight.grad.to_dense())
        if not sparse_only:
            torch.testing.assert_close(model.head.weight.grad, ref.head.weight.grad)
    # An optimizer made for sparse gradients steps as on the bare module.
    for model in (ref, ours):
        torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1).step()
    torch.testing.assert_close(ours.emb.weight, ref.emb.weight)


def test_double_backward_through_replicas_matches_the_bare_module():
    """A gradient penalty (create_graph=True) differentiates through the replicas' copies."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(ref)
    x = torch.randn(6, 3)
    for net in (ref, DataParallel(model, CPU2)):
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(net(xi).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
    _assert_grads_equal(_grads(model), _grads(ref))


# --- 3. buffers that require grad --------------------------------------------------------------


class ScaledByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.register_buffer("scale", torch.rand(3, dtype=torch.double, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_gradcheck_through_the_wrapper_with_a_buffer_that_requires_grad():
    torch.manual_seed(0)
    model = ScaledByBuffer()
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    for wrapper in (DataParallel(model, CPU2), nn.DataParallel(model)):
        assert torch.autograd.gradcheck(lambda x, scale, w=wrapper: w(x), (x, model.scale))
    model.scale.grad = None
    DataParallel(model, CPU2)(x).sum().backward()
    got = model.scale.grad.clone()
    model.scale.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(got, model.scale.grad)


# --- 4. random numbers on a CPU device list ----------------------------------------------------


def _dropout_net() -> nn.Module:
    torch.manual_seed(1)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(64, 64), nn.Dropout(0.3)]
    return nn.Sequential(*layers)


def test_cpu_replicas_draw_in_turn_as_the_module_does_chunk_by_chunk():
    model, x = _dropout_net(), torch.randn(32, 64)
    for seed in range(4):
        torch.manual_seed(seed)
        expected = torch.cat([model(chunk) for chunk in x.chunk(2)])
        after_expected = torch.rand(3)
        torch.manual_seed(seed)
        got = DataParallel(model, CPU2)(x)
        after = torch.rand(3)  # the generator continues where the chunk-by-chunk run left it
        assert torch.equal(got, expected), f"seed {seed}"
        assert torch.equal(after, after_expected), f"seed {seed}"


def test_cpu_replicas_never_share_a_mask_and_one_dropout_matches_torch():
    drop, half = nn.Dropout(0.5), torch.ones(4, 256)
    x = torch.cat([half, half])  # identical halves: a shared mask would give identical outputs
    torch.manual_seed(0)
    ours = DataParallel(drop, CPU2)(x)
    torch.manual_seed(0)
    theirs = nn.DataParallel(drop)(x)  # on the CPU: the module on the whole batch
    assert not torch.equal(ours[:4], ours[4:])
    # One dropout draws element by element, so chunks in turn give the whole batch's mask.
    assert torch.equal(ours, theirs)


class _MeetsInEval(nn.Module):
    """Waits for the other replica in eval mode: proves eval-mode replicas still run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.barrier = threading.Barrier(2, timeout=20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not any(m.training for m in self.modules()):
            self.barrier.wait()
        return self.drop(self.lin(x))


def test_turns_follow_any_training_submodule_and_eval_replicas_run_at_once():
    model, x = _MeetsInEval(), torch.randn(8, 4)
    dp = DataParallel(model, CPU2)
    # MC dropout: the model in eval mode but its dropout switched back on. Turns still apply.
    model.eval()
    model.drop.train()
    torch.manual_seed(3)
    expected = torch.cat([model.drop(model.lin(chunk)) for chunk in x.chunk(2)])
    torch.manual_seed(3)
    assert torch.equal(dp(x), expected)
    model.drop.eval()  # everything in eval mode: both replicas meet at the barrier
    torch.testing.assert_close(dp(x), model.lin(x))


# --- 5. torch's overridable steps --------------------------------------------------------------


class Recording(DataParallel):
    """Overrides all four steps, as a torch user's subclass of nn.DataParallel would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def scatter(self, inputs, kwargs, device_ids):
        self.calls.append("scatter")
        return super().scatter(tuple(t * 2 for t in inputs), kwargs, device_ids)

    def replicate(self, module, device_ids):
        self.calls.append(f"replicate:{len(device_ids)}")
        return super().replicate(module, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        self.calls.append(f"parallel_apply:{len(replicas)}")
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        self.calls.append("gather")
        return list(outputs)  # keep the per-replica outputs apart


def test_subclass_overrides_of_the_four_steps_take_effect():
    lin = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    dp = Recording(lin, CPU2)
    outs = dp(x)
    assert dp.calls == ["scatter", "replicate:2", "parallel_apply:2", "gather"]
    assert isinstance(outs, list) and len(outs) == 2
    torch.testing.assert_close(torch.cat(outs), lin(x * 2))
    one = Recording(lin, ["cpu"])
    torch.testing.assert_close(one(x), lin(x * 2))  # one device: scatter still applies
    assert one.calls == ["scatter"]
    loss_mode = Recording(lin, CPU2, loss_fn=nn.MSELoss())
    target = torch.zeros(5, 2)
    torch.testing.assert_close(loss_mode(x, targets=target), nn.MSELoss()(lin(x * 2), target))
    assert loss_mode.calls == ["scatter", "replicate:2", "parallel_apply:2"]


def test_the_four_steps_have_torchs_signatures():
    for name in ("scatter", "replicate", "parallel_apply", "gather"):
        ours = list(inspect.signature(getattr(DataParallel, name)).parameters)
        theirs = list(inspect.signature(getattr(nn.DataParallel, name)).parameters)
        assert len(ours) == len(theirs), name


# --- 6. not a module ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, torch.ones(2), torch.neg], ids=["int", "tensor", "function"])
def test_wrapping_something_that_is_not_a_module_is_a_type_error_at_construction(bad):
    with pytest.raises(TypeError, match=rf"DataParallel wraps an nn.Module, but was given {type(bad).__name__}"):
        DataParallel(bad, CPU2)
    if callable(bad):
        return  # torch on the CPU calls it as it is (with GPUs its constructor fails)
    # torch accepts it on the CPU and fails only when called, from inside its forward.
    with pytest.raises(TypeError, match="not callable"):
        nn.DataParallel(bad)(torch.ones(2))


# --- 7. one walk over nested batches -----------------------------------------------------------


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    tag: str


def test_the_loader_and_scatter_walk_dataclasses_like_lockstep_tensors():
    moved = move_to_device({"b": Batch(torch.ones(2), "t")}, torch.device("meta"))
    assert moved["b"].x.device.type == "meta" and moved["b"].tag == "t"

    class Head(nn.Module):
        def forward(self, batch: Batch) -> torch.Tensor:
            return batch.x * 2

    x = torch.arange(6.0)
    torch.testing.assert_close(DataParallel(Head(), CPU2)(Batch(x, "t")), nn.DataParallel(Head())(Batch(x, "t")))
    # A mapping whose constructor wants more than the items is scattered as a plain dict.
    batch = collections.defaultdict(list, x=x)
    pieces = lockstep.dp.scatter((batch,), CPU2)
    assert all(torch.equal(p[0]["x"], half) for p, half in zip(pieces, x.chunk(2)))


# --- 8. the sampler's set_epoch warning --------------------------------------------------------


def _loader(sampler_cls: type) -> tuple[Any, DataLoader]:
    dataset = list(range(16))
    sampler = sampler_cls(dataset, num_replicas=2, rank=0, shuffle=True)
    return sampler, DataLoader(dataset, batch_size=4, sampler=sampler)


def test_peeking_at_a_batch_before_the_epoch_loop_does_not_warn():
    """pytorch/examples' DDP tutorial: next(iter(loader)) for the batch size, then the loop."""
    seen = []
    for cls in (DistributedSampler, torch.utils.data.DistributedSampler):
        sampler, loader = _loader(cls)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = [next(iter(loader))]
            for epoch in range(3):
                sampler.set_epoch(epoch)
                batches += list(loader)
        seen.append(batches)
    for a, b in zip(*seen):  # and the very same batches as torch's sampler
        assert torch.equal(a, b)


def _passes(loader: DataLoader, batches_each: list[int | None]) -> list[str]:
    """Iterate ``loader`` once per entry (stopping after that many batches); the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for limit in batches_each:
            for i, _batch in enumerate(loader):
                if limit is not None and i + 1 >= limit:
                    break
    return [str(w.message) for w in caught]


def test_a_forgotten_set_epoch_still_warns():
    # A peek, then two full epochs without set_epoch: the second full pass replays the first.
    _, loader = _loader(DistributedSampler)
    assert _passes(loader, [1, None]) == []
    messages = _passes(loader, [None])
    assert len(messages) == 1 and "same epoch as the previous pass" in messages[0]
    # Epochs that each stop early: the replay shows at the third pass.
    _, loader = _loader(DistributedSampler)
    assert _passes(loader, [2, 2]) == []
    messages = _passes(loader, [2, 2])
    assert len(messages) == 1 and "set_epoch(epoch)" in messages[0]
