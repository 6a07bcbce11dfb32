"""Pipeline fixes from the pp11 audit: tied weights, clipping, buffers, balance='time', edges."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_pipeline_distributed import _plain, _tensors
from torch import nn
from torch.nn import functional as F

import lockstep

INF = float("inf")
NORMS = [2.0, 1.0, INF]




class _Embed(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(ids)


class _Head(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, h):
        return h @ self.emb.weight.t()


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    emb = nn.Embedding(11, 8)
    return nn.Sequential(_Embed(emb), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _Head(emb))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3))


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g) * 4, torch.randn(8, 3, generator=g)


# ---- 1. tied weights ----------------------------------------------------------------------
def test_tied_weights_on_one_device_still_train_like_the_model():
    ids = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))
    ref, model = _tied(), _tied()
    pipe = lockstep.Pipeline(model, 3, devices=["cpu", "cpu"], loss_fn=lambda o: o.pow(2).mean())
    pipe.step(ids)
    ref(ids).pow(2).mean().backward()
    torch.testing.assert_close(model[0].emb.weight.grad, ref[0].emb.weight.grad)


def test_tied_weights_on_two_devices_are_refused_naming_both_stages():
    with pytest.raises(ValueError, match=r"parameter '0\.emb\.weight' is used by stage 0 and by "
                                         r"stage 1 \(as '4\.emb\.weight' there\).*balance"):
        lockstep.Pipeline(_tied(), 2, devices=["cpu", "meta"])


def _tied_world(rank: int) -> str:
    lockstep.init_distributed()
    try:
        lockstep.Pipeline(_tied(), 2, loss_fn=F.mse_loss)
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.multirank
def test_tied_weights_over_ranks_are_refused_on_every_rank():
    results = lockstep.spawn(_tied_world, 2, timeout=60)
    for message in results:
        assert "parameter '0.emb.weight' is used by stage 0 and by stage 1" in message
        assert "different ranks" in message and "untie" in message


# ---- 2. clipping --------------------------------------------------------------------------
def _reference_clipped(norm_type: float, max_norm: float):
    model = _mlp()
    x, y = _batch()
    F.mse_loss(model(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return total, {n: p.grad for n, p in model.named_parameters()}


def test_local_clip_grad_norm_equals_torch_on_the_whole_model():
    for norm_type in NORMS:
        pipe = lockstep.Pipeline(_mlp(), 2, devices=["cpu", "cpu"], loss_fn=F.mse_loss)
        pipe.step(*_batch()[:1], target=_batch()[1])
        total = pipe.clip_grad_norm_(0.05, norm_type)
        ref_total, ref_grads = _reference_clipped(norm_type, 0.05)
        torch.testing.assert_close(total, ref_total, atol=1e-6, rtol=1e-6)
        for stage in pipe.stages:
            for name, param in stage.named_parameters():
                torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-6, rtol=1e-6)


def _clip_world(rank: int) -> dict:
    lockstep.init_distributed()
    results = {}
    x, y = _batch()
    for norm_type in NORMS:
        pipe = lockstep.Pipeline(_mlp(), 2, loss_fn=F.mse_loss)
        pipe.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        total = pipe.clip_grad_norm_(0.05, norm_type)
        grads = {n: p.grad.clone() for n, p in pipe.stage.named_parameters()}
        results[str(norm_type)] = (total, grads)
    if rank == 1:  # one stage's non-finite gradient makes every rank's norm non-finite
        next(pipe.stage.parameters()).grad[0] = float("nan")
    try:
        pipe.clip_grad_norm_(0.05, error_if_nonfinite=True)
    except RuntimeError as exc:
        results["nonfinite"] = str(exc)
    return _plain(results)


@pytest.mark.multirank
def test_clip_grad_norm_over_ranks_equals_torch_on_the_unsplit_model():
    results = _tensors(lockstep.spawn(_clip_world, 2, timeout=60))
    for norm_type in NORMS:
        ref_total, ref_grads = _reference_clipped(norm_type, 0.05)
        assert ref_total > 0.05  # the test clips
        for rank in range(2):
            total, grads = results[rank][str(norm_type)]
            torch.testing.assert_close(total, ref_total, atol=1e-6, rtol=1e-6)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-6)
    for rank in range(2):
        assert "norm of order 2.0 of the pipeline's gradients is nan" in results[rank]["nonfinite"]


def _clip_ddp_world(rank: int) -> dict:
    """Ranks 0,1 and 2,3 are two pipelines; ranks 0,2 and 1,3 replicate a stage."""
    lockstep.init_distributed()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    pipe = lockstep.Pipeline(_mlp(), 2, loss_fn=F.mse_loss, process_group=pipelines[replica])
    pipe.stage = lockstep.DistributedDataParallel(pipe.stage, process_group=replicas[stage])
    x, y = (t.chunk(2)[replica] for t in _batch())
    pipe.step(*((x,) if stage == 0 else ()), target=y if stage == 1 else None)
    total = pipe.clip_grad_norm_(0.05)
    return _plain((total, {n: p.grad.clone() for n, p in pipe.stage.module.named_parameters()}))


@pytest.mark.multirank
def test_clip_grad_norm_with_replicated_stages_equals_torch_on_the_whole_batch():
    results = _tensors(lockstep.spawn(_clip_ddp_world, 4, timeout=60))
    ref_total, ref_grads = _reference_clipped(2.0, 0.05)
    for total, grads in results:
        torch.testing.assert_close(total, ref_total, atol=1e-6, rtol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-6)


# ---- 3. the docs' data recipe -------------------------------------------------------------
def test_the_docs_multi_rank_recipes_draw_data_from_their_own_generator():
    text = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    snippets = re.findall(r"<!-- launch: \d+ -->\n```python\n(.*?)```", text, re.DOTALL)
    stepping = [s for s in snippets if "pipe.step(" in s]
    assert len(stepping) >= 3
    for snippet in stepping:
        for line in snippet.splitlines():
            draws = len(re.findall(r"torch\.(?:randn|randint|rand)\(", line))
            assert line.count("generator=") == draws, line


# ---- 4. buffers of DDP-replicated stages --------------------------------------------------
def _ddp_buffer_world(rank: int) -> dict:
    lockstep.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    pipelines = [dist.new_group([0]), dist.new_group([1])]
    replicas = dist.new_group([0, 1])
    pipe = lockstep.Pipeline(model, 2, loss_fn=F.mse_loss, process_group=pipelines[rank])
    pipe.stage = lockstep.DistributedDataParallel(pipe.stage, process_group=replicas)
    seen: list = []
    # What the stage's buffers are when a step's first forward starts (after DDP's broadcast).
    model[0].register_forward_pre_hook(
        lambda *_: seen.append(model[1].running_mean.clone()) if len(seen) < 4 * 4 else None)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)  # each replica its own data
    for _ in range(4):
        opt.zero_grad()
        pipe.step(torch.randn(8, 6, generator=g) * (rank + 1), target=torch.randn(8, 3, generator=g))
        opt.step()
    return _plain(seen[::2])  # 2 micro-batches a step: the first forward of each step


@pytest.mark.multirank
def test_replicated_stages_sync_buffers_once_per_step_like_ddp():
    results = _tensors(lockstep.spawn(_ddp_buffer_world, 2, timeout=60))
    assert len(results[0]) == 4
    for step, (a, b) in enumerate(zip(results[0], results[1])):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"step {step}")


# ---- 5. balance="time" leaves the model alone ---------------------------------------------
def test_balance_time_leaves_buffers_and_rng_unchanged():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.5),
                             nn.Linear(16, 3))

    model, ref = build(), build()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    sample = torch.randn(8, 6) * 5 + 3
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    lockstep.Pipeline(model, 2, loss_fn=F.cross_entropy, devices=["cpu"] * 2, balance="time",
                      sample_input=sample)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[4].weight.grad is None


# ---- 6. an in-place first layer -----------------------------------------------------------
def test_a_stage_starting_with_an_in_place_layer_trains_like_the_model():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 32),
                             nn.ReLU(inplace=True), nn.Linear(32, 4))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    ref = build()
    F.cross_entropy(ref(x), y).backward()
    for balance in ([1, 4], [3, 2]):
        model = build()
        pipe = lockstep.Pipeline(model, 2, loss_fn=F.cross_entropy, devices=["cpu"] * 2,
                                 balance=balance)
        pipe.step(x, target=y)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.grad, ref_param.grad, msg=f"{balance} {name}")


class _InPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2)


def test_an_in_place_layer_the_pipeline_cannot_see_gets_a_hint():
    pipe = lockstep.Pipeline([nn.Linear(4, 4), nn.Sequential(nn.Identity(), _InPlace())], 2,
                             devices=["cpu"] * 2, loss_fn=lambda o: o.sum())
    with pytest.raises(RuntimeError, match=r"stage 1 failed .*layer of stage 1 writes in place"):
        pipe.step(torch.randn(4, 4))


# ---- 7. a 0-dim output of the last stage --------------------------------------------------
class _WithAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        out = self.lin(x)
        return out, out.pow(2).mean()


def test_a_0_dim_output_of_the_last_stage_is_refused_before_any_backward():
    pipe = lockstep.Pipeline([nn.Linear(6, 6), _WithAux()], 2, devices=["cpu"] * 2,
                             loss_fn=lambda out, y: F.cross_entropy(out[0], y) + out[1])
    with pytest.raises(ValueError, match=r"stage 1 \(the last\) returned a 0-dim tensor as "
                                         r"output 1.*reshape\(1\)"):
        pipe.step(torch.randn(8, 6), target=torch.randint(0, 3, (8,)))
    assert all(p.grad is None for p in pipe.parameters())


# ---- 8. a non-tensor output names the stage -----------------------------------------------
class _Dict(nn.Module):
    def forward(self, x):
        return {"x": x}


def test_a_non_tensor_output_names_the_stage():
    pipe = lockstep.Pipeline([nn.Linear(4, 4), _Dict()], 2, devices=["cpu"] * 2,
                             loss_fn=lambda o: o.sum())
    with pytest.raises(TypeError, match=r"pipeline stage 1's output must be a tensor"):
        pipe.step(torch.randn(4, 4))
