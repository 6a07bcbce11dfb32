"""Tests of lockstep.fully_shard (full sharding, ZeRO-3) on gloo/CPU.

Tiers: a world of one in this process (layout, freeing, errors); worlds of 2 and 3 through
``lockstep.spawn``, each running every equivalence check in one world against a single-process
reference on the whole batch: AdamW on a small transformer (per-block units, uneven shards, a
tied embedding/head inside the root unit), frozen parameters, accumulation without
communication, global-norm clipping, ``reshard_after_forward=False`` and mixed precision.
"""

from __future__ import annotations

import copy
import os
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import lockstep
from lockstep.fsdp import (
    MixedPrecisionPolicy,
    ModelState,
    clip_grad_norm_,
    full_state_dict,
    no_sync,
    set_reshard_after_forward,
)
from lockstep.fsdp.api import mesh_groups
from lockstep.fsdp.unit import FSDPUnit, get_unit
from lockstep.shards import is_shard

STEPS = 3
BATCH = 12  # divisible by worlds 1, 2 and 3
VOCAB, DIM, SEQ = 11, 10, 5  # 10x10 weights: 100 elements, not divisible by 3
TOL = 1e-10  # float64, plain SGD: only summation order differs from the reference
ADAMW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}


# -- the model (module level: spawned workers import it) ---------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No qkv bias: the key bias's gradient is exactly zero (softmax ignores a shift of the
        # scores), and Adam would turn its rounding noise into full-size steps.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim + 1), nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, inside the root unit

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _model(dtype: torch.dtype = torch.float64) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT().to(dtype)


def _shard(model: TinyGPT, **kwargs: Any) -> TinyGPT:
    for block in model.blocks:
        lockstep.fully_shard(block, **kwargs)
    lockstep.fully_shard(model, **kwargs)
    return model


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen))
        for _ in range(n)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y.flatten())


def _mine(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = len(t) // size
    return t[rank * per : (rank + 1) * per]


def _diff(model: nn.Module, ref: nn.Module) -> float:
    full = full_state_dict(model)
    return max((full[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items())


# -- tier 1: a world of one in this process ------------------------------------------------------


def _train_both(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module,
                opt: torch.optim.Optimizer, rank: int, size: int, steps: int = STEPS) -> None:
    """The reference on the whole batch, the sharded model on this rank's part, step by step."""
    for x, y in _batches(steps):
        _step_both(ref, ref_opt, model, opt, x, y, rank, size)


def _step_both(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module,
               opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, rank: int,
               size: int) -> None:
    ref_opt.zero_grad()
    _loss(ref, x, y).backward()
    ref_opt.step()
    opt.zero_grad()
    _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
    opt.step()


def _unit(module: nn.Module) -> FSDPUnit:
    unit = get_unit(module)
    assert unit is not None
    return unit


def _full_bytes(module: nn.Module) -> int:
    unit = _unit(module)
    return sum(s.full.untyped_storage().nbytes() for s in unit.flat.slots)


def test_shards_are_the_parameters_and_world_one_trains_like_plain():
    ref, model = _model(), _model()
    _shard(model)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]  # same names, tie kept once
    # Each shard keeps its parameter's number of dimensions (its elements in the last), as
    # torch's DTensor shards do: optimizer groups split by p.dim() (nanoGPT's weight decay,
    # timm's) split the sharded model as the plain one (every shard was 1-D until 2026-11-29).
    assert [p.dim() for p in model.parameters()] == [p.dim() for p in ref.parameters()]
    assert all(p.shape[:-1] == (1,) * (p.dim() - 1) for p in model.parameters())
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    for x, y in _batches(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    assert _diff(model, ref) < TOL
    unsharded = TinyGPT().to(torch.float64)
    unsharded.load_state_dict(full_state_dict(model))  # the full state dict loads unsharded


class _CheckpointedInside(TinyGPT):
    """Activation checkpointing inside the units: each block recomputes its MLP, the root its
    head (the common `checkpoint(self.mlp, x)` in a block's forward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        for block in self.blocks:
            block.forward = partial(self._block_forward, block)  # type: ignore[method-assign]

    def _ckpt(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=self.reentrant)

    def _block_forward(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=-1)
        x = x + block.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self._ckpt(lambda h: block.down(F.gelu(block.up(block.ln2(h)))), x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self._ckpt(lambda t: self.head(self.norm(t)), h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_inside_a_unit_trains_like_plain(reentrant):
    """The recomputation reads the modules' attributes during backward: they show the full
    parameters until the unit's backward is over, as torch's fully_shard does (they showed the
    1-D shards: a shape error, or checkpoint's "different metadata" error)."""
    torch.manual_seed(0)
    ref = _CheckpointedInside(reentrant).to(torch.float64)
    torch.manual_seed(0)
    model = _shard(_CheckpointedInside(reentrant).to(torch.float64))
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    _train_both(ref, ref_opt, model, opt, 0, 1, steps=3)
    assert _diff(model, ref) < TOL
    assert all(p.shape[:-1] == (1,) * (p.dim() - 1) for p in model.parameters())  # shards again
    assert _full_bytes(model.blocks[0]) == 0


def test_parameters_are_freed_after_forward_and_backward():
    model = _shard(_model())  # reshard_after_forward=None: torch's default
    x, y = _batches(1)[0]
    loss = _loss(model, x, y)
    # The blocks reshard after forward; the root keeps its own parameters for backward, which
    # needs them first (torch's default, reshard_after_forward=None).
    assert _full_bytes(model.blocks[0]) == 0 and _full_bytes(model) > 0
    loss.backward()
    assert _full_bytes(model.blocks[0]) == 0 and _full_bytes(model) == 0
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    model = _shard(_model(), reshard_after_forward=True)
    loss = _loss(model, x, y)
    assert _full_bytes(model) == 0  # True: the root's are freed after forward too
    loss.backward()
    kept = _shard(_model(), reshard_after_forward=False)
    loss = _loss(kept, x, y)
    assert _full_bytes(kept.blocks[0]) > 0  # kept for backward
    loss.backward()
    assert _full_bytes(kept.blocks[0]) == 0  # freed once its gradients are reduced


def test_parameter_shared_across_units_is_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    lockstep.fully_shard(a)
    # Refused at b's call: until 2026-11-29 only the parent's call looked, and only while the
    # original weight was still alive (it is garbage once both hold shards), so the tie could
    # be broken silently.
    with pytest.raises(ValueError, match="Linear's parameter 'weight' is shared with Linear, "
                       "sharded earlier"):
        lockstep.fully_shard(b)
    inner = nn.Linear(4, 4)
    outer = nn.Sequential(inner, nn.Linear(4, 4))
    outer[1].weight = inner.weight
    lockstep.fully_shard(inner)
    with pytest.raises(ValueError, match="parameter '1.weight' is shared"):
        lockstep.fully_shard(outer)


def test_forward_before_the_root_is_sharded_is_refused():
    model = _model()
    for block in model.blocks:
        lockstep.fully_shard(block)
    _loss(model, *_batches(1)[0])
    with pytest.raises(RuntimeError, match="'blocks.0' already ran forward"):
        lockstep.fully_shard(model)


def test_parameters_on_different_devices_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="'1.weight' on meta"):
        lockstep.fully_shard(model)
    with pytest.raises(ValueError, match="already fully sharded"):
        lockstep.fully_shard(lockstep.fully_shard(nn.Linear(2, 2)))


def test_containers_without_forward_are_refused_at_the_call():
    # Before #30 fully_shard(nn.ModuleList) was accepted and failed later inside a matmul.
    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        with pytest.raises(ValueError, match=f"containers that do not implement forward: {type(container).__name__}"):
            lockstep.fully_shard(container)
    lockstep.fully_shard(nn.Sequential(nn.Linear(2, 2)))  # a container with a forward is fine
    # torch's list form (one group over several modules): refused by name, not list.forward.
    with pytest.raises(NotImplementedError, match="got a list of 2 modules.*call fully_shard on each"):
        lockstep.fully_shard([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="expects an nn.Module, got function"):
        lockstep.fully_shard(lambda x: x)


def test_a_block_sharded_after_its_root_is_refused_at_the_call():
    # Until 2026-11-29 it was accepted, and the first forward blamed model.to() or a new Parameter.
    model = lockstep.fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="parameter 'weight' is already a shard of a module sharded earlier.*bottom-up"):
        lockstep.fully_shard(model[0])


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.never = nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_unused_parameters_keep_none_gradients_like_torch():
    # Before #30 they got zero gradients, which AdamW's weight decay then moved.
    ref, model = _WithUnused(), lockstep.fully_shard(_WithUnused())
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    x = torch.randn(3, 4, dtype=torch.float64)
    for m, o in ((ref, ref_opt), (model, opt)):
        for _ in range(2):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    assert model.never.weight.grad is None and model.never.bias.grad is None
    assert model.used.weight.grad is not None
    assert _diff(model, ref) < TOL


def test_unshard_and_reshard_are_public_and_not_recursive():
    model = _shard(_model())
    block = model.blocks[0]
    shapes = {n: p.shape for n, p in _model().blocks[0].named_parameters()}
    assert lockstep.fsdp.unshard(block) is None
    assert {n: p.shape for n, p in block.named_parameters()} == shapes
    assert _full_bytes(block) > 0 and _full_bytes(model.blocks[1]) == 0 and _full_bytes(model) == 0
    lockstep.fsdp.reshard(block)
    assert all(p.shape[:-1] == (1,) * (p.dim() - 1) for p in block.parameters())
    assert _full_bytes(block) == 0
    handle = lockstep.fsdp.unshard(block, async_op=True)
    assert isinstance(handle, lockstep.fsdp.UnshardHandle)
    handle.wait()
    assert {n: p.shape for n, p in block.named_parameters()} == shapes
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()  # forward uses the gathered block, then frees it as usual
    assert _full_bytes(block) == 0
    with pytest.raises(ValueError, match="unshard: Linear is not fully sharded"):
        lockstep.fsdp.unshard(nn.Linear(2, 2))


def test_reshard_after_backward_false_skips_the_next_gather_and_accumulates_exactly():
    ref, model = _model(), _shard(_model())
    batches = _batches(3)
    for x, y in batches:
        _loss(ref, x, y).backward()
    lockstep.fsdp.set_reshard_after_backward(model, False)
    with no_sync(model):
        for x, y in batches[:2]:
            with lockstep.fsdp.record_events(model) as events:
                _loss(model, x, y).backward()
            assert _full_bytes(model.blocks[0]) > 0  # kept gathered after backward
    forward = events[: events.index(("forward-end", "")) + 1]
    assert not [e for e in forward if e[0] == "gather-issued"]  # the second forward did not gather
    lockstep.fsdp.set_reshard_after_backward(model, True)
    _loss(model, *batches[2]).backward()
    assert _full_bytes(model.blocks[0]) == 0
    full = {n: p.grad for n, p in ref.named_parameters()}
    for name, shard in model.named_parameters():
        assert torch.allclose(shard.grad[: full[name].numel()], full[name].reshape(-1)[: shard.numel()], atol=TOL)


_DEEPCOPY = """
import copy, torch, lockstep
from torch import nn
model = lockstep.fully_shard(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
model(torch.randn(2, 3)).sum().backward()
try:
    copy.deepcopy(model)
except RuntimeError as e:
    print("refused:", e)
"""


def test_deepcopy_is_a_clear_error_not_a_crash():
    # A subprocess: before #30 deepcopy killed the process with SIGSEGV.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEEPCOPY], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "refused: copy.deepcopy of a fully_shard-ed module (Sequential)" in done.stdout
    assert "full_state_dict" in done.stdout


def test_reshard_after_forward_as_an_int_reads_as_torch_reads_it():
    model = _shard(_model(), reshard_after_forward=1)  # 1: keep gathered, as torch's 1 (world 1 here)
    assert not _unit(model).reshard_after_forward
    with pytest.raises(ValueError, match="factor of the shard group's 1 ranks"):
        lockstep.fully_shard(_model(), reshard_after_forward=2)
    with pytest.raises(ValueError, match="a bool or an int"):
        lockstep.fully_shard(_model(), reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True or False"):
        set_reshard_after_forward(model, 1)  # type: ignore[arg-type]


def test_parameters_converted_or_replaced_after_fully_shard_are_named():
    x = _batches(1)[0][0]
    converted = _shard(_model()).to(torch.float32)  # torch's FSDP would train in float32
    with pytest.raises(RuntimeError, match="'embed.weight' of TinyGPT was converted to torch.float32"):
        converted(x)
    with torch.device("meta"):
        meta = _shard(TinyGPT().double())
    meta.to_empty(device="cpu")  # torch's meta-device initialisation
    with pytest.raises(RuntimeError, match="was replaced after fully_shard .sharded as torch.float64 on meta"):
        meta(x)
    with pytest.raises(RuntimeError, match="was replaced after fully_shard"):
        ModelState(meta).load_state_dict(_model().state_dict())  # not a misleading shape error


def unlaunched_worker(rank: int) -> dict:
    """fully_shard in a launched process without a process group: torch's makes the default one
    from the environment, and so does lockstep's; a model sharded as a world of one (no
    launcher's environment yet) is refused at its forward once the group is larger."""
    assert not dist.is_initialized()
    launch = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE")}
    early = _shard(_model())  # as plain `python`: a world of one
    os.environ.update(launch)
    ref, model = _model(), _shard(_model())
    out: dict = {"made": dist.is_initialized() and dist.get_world_size() == 2}
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    _train_both(ref, ref_opt, model, opt, rank, 2, steps=2)
    out["diff"] = _diff(model, ref)
    with pytest.raises(RuntimeError) as caught:
        early(_batches(1)[0][0])
    out["early"] = str(caught.value)
    return out


@pytest.mark.multirank
def test_fully_shard_makes_the_default_group_from_the_launch_environment():
    for out in lockstep.spawn(unlaunched_worker, 2, timeout=120):
        assert out["made"] and out["diff"] < TOL
        assert "was sharded across 1 rank(s) but its group now has 2" in out["early"]
        assert "before the process group existed" in out["early"]


# -- the checks, each against a single-process reference --------------------------------------


def _check_adamw(
    rank: int, size: int, out: dict, key: str, *, freeze: bool = False, **shard_kwargs: Any
) -> None:
    ref, model = _model(), _model()
    if freeze:
        for m in (ref, model):
            m.blocks[0].qkv.requires_grad_(False)
    _shard(model, **shard_kwargs)
    in_flight: list[int] = []  # reductions already launched when backward reaches the embedding

    def probe(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        state = _unit(model).root
        assert state is not None
        output.register_hook(lambda grad: in_flight.append(len(state.pending)))

    model.embed.register_forward_hook(probe)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    _train_both(ref, ref_opt, model, opt, rank, size)
    out[key] = _diff(model, ref)
    out[key + "_in_flight"] = min(in_flight)
    if freeze:
        out["frozen_grad_is_none"] = model.get_parameter("blocks.0.qkv.weight").grad is None


def _check_no_sync(rank: int, size: int, out: dict) -> None:
    """Two micro-batches without communication, the third with: equal to the summed gradient."""
    ref, model = _model(), _model()
    _shard(model)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    batches = _batches(3)
    for x, y in batches:
        _loss(ref, x, y).backward()
    ref_opt.step()
    with no_sync(model):
        for x, y in batches[:2]:
            _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
    out["no_sync_no_grad"] = all(p.grad is None for p in model.parameters())
    x, y = batches[2]
    _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
    opt.step()
    out["no_sync"] = _diff(model, ref)


def _check_clip(rank: int, size: int, out: dict) -> None:
    ref, model = _model(), _model()
    _shard(model)
    x, y = _batches(1)[0]
    _loss(ref, x, y).backward()
    _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = clip_grad_norm_(model, 0.1)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out["clip_norm"] = abs(norm.item() - ref_norm.item())
    out["clip_clipped"] = ref_norm.item() > 0.1
    out["clip"] = _diff(model, ref)
    # torch's call form, clip_grad_norm_(model.parameters(), ...) (an AttributeError before),
    # with a module left unsharded beside the shards: its gradient counts once.
    ref, model = _model(), _model()
    lockstep.fully_shard(model.blocks[0])
    lockstep.fully_shard(model.blocks[1])
    x, y = _batches(1)[0]
    _loss(ref, x, y).backward()
    _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
    for p in model.parameters():
        if p.grad is not None and not is_shard(p):
            dist.all_reduce(p.grad)  # the unsharded root's gradient averaged by hand
            p.grad.div_(size)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, error_if_nonfinite=True)
    out["clip_params_norm"] = abs(clip_grad_norm_(model.parameters(), 0.1).item() - ref_norm.item())


def _check_mixed_precision(rank: int, size: int, out: dict) -> None:
    """bf16 compute, fp32 reduction, fp32 shards vs one process doing the same arithmetic.

    The reference casts its fp32 master weights to bf16, computes each rank's part of the batch
    in bf16 and averages the gradients in fp32 (``mp``: only the order of the fp32 sums differs).
    ``mp_vs_fp32`` is how far bf16 compute is from fp32 compute at all: the scale of the first.
    """
    ref, model, fp32 = _model(torch.float32), _model(torch.float32), _model(torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(model, mp_policy=policy)
    opts = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (ref, model, fp32)]
    for x, y in _batches(STEPS):
        low = copy.deepcopy(ref).to(torch.bfloat16)
        for p in ref.parameters():
            p.grad = torch.zeros_like(p)
        for r in range(size):  # each rank's bf16 gradient, summed in fp32
            grads = torch.autograd.grad(_loss(low, _mine(x, r, size), _mine(y, r, size)), list(low.parameters()))
            for p, g in zip(ref.parameters(), grads):
                p.grad = p.grad + g.float() / size if p.grad is not None else g.float() / size
        _loss(fp32, x, y).backward()
        _loss(model, _mine(x, rank, size), _mine(y, rank, size)).backward()
        out["mp_grad_dtype"] = str(getattr(next(model.parameters()).grad, "dtype", None))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["mp_shard_dtype"] = str(next(model.parameters()).dtype)
    out["mp"] = _diff(model, ref)
    out["mp_vs_fp32"] = _diff(model, fp32)


def _check_without_tensor_collectives(rank: int, size: int, out: dict) -> None:
    """A gloo without the tensor all-gather/reduce-scatter: the fallbacks give the same result."""
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def missing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this backend does not support the tensor form")

    try:
        for n in saved:
            setattr(dist, n, missing)
        _check_adamw(rank, size, out, "adamw_fallback")
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _check_freeze_after_shard(rank: int, size: int, out: dict) -> None:
    """requires_grad changed between steps after fully_shard (a block frozen, then unfrozen,
    then another frozen), as torch's FSDP allows: the same as the reference doing the same."""
    ref, model = _model(), _model()
    _shard(model)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    plan = [("blocks.0", False), ("blocks.0", True), ("blocks.1.up", False)]
    got = []
    for (x, y), (where, flag) in zip(_batches(len(plan)), plan):
        for m in (ref, model):
            m.get_submodule(where).requires_grad_(flag)
        _step_both(ref, ref_opt, model, opt, x, y, rank, size)
        got.append(sorted(n for n, p in model.named_parameters() if p.grad is not None)
                   == sorted(n for n, p in ref.named_parameters() if p.grad is not None))
    out["freeze_after_shard"] = _diff(model, ref)
    out["freeze_after_shard_grads"] = all(got)


class _Recomputed(nn.Module):
    """Runs ``inner`` under activation checkpointing that recomputes the whole block, forward
    hooks included (early stop off): the unit's hooks run again inside backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=False)


def _check_recomputed_blocks(rank: int, size: int, out: dict) -> None:
    ref, model = _model(), _model()
    model.blocks = nn.ModuleList([_Recomputed(block) for block in model.blocks])
    for block in model.blocks:
        lockstep.fully_shard(block.inner)
    lockstep.fully_shard(model)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    _train_both(ref, ref_opt, model, opt, rank, size)
    ref.blocks = nn.ModuleList([_Recomputed(block) for block in ref.blocks])  # the same names
    out["recomputed"] = _diff(model, ref)


def _check_different_models(rank: int, size: int, out: dict) -> None:
    """A rank whose model differs is named on every rank at the first forward (not a gloo abort)."""
    torch.manual_seed(0)
    model = lockstep.fully_shard(nn.Sequential(nn.Linear(4, 6 if rank == size - 1 else 4), nn.Tanh()))
    with pytest.raises(lockstep.ReplicaMismatchError) as caught:
        model(torch.ones(2, 4))
    out["different_models"] = str(caught.value)


def _check_forward_after_shards_changed(rank: int, size: int, out: dict) -> None:
    """The root stays gathered after a forward no backward follows; shards changed in between
    (an EMA teacher's update, a load into the model) must reach the next forward. Until
    2026-11-29 that forward used the stale gather, silently."""
    ref, model = _model(), _model()
    _shard(model)
    x, _ = _batches(1)[0]
    drift = 0.0
    for _ in range(3):  # an EMA teacher: forward under no_grad, then an in-place update
        with torch.no_grad():
            drift = max(drift, (model(x) - ref(x)).abs().max().item())
            for mine, theirs in zip(model.parameters(), ref.parameters()):
                mine.mul_(0.5)
                theirs.mul_(0.5)
    with torch.no_grad():
        other = _model()
        other.norm.weight.add_(1.0)  # a root parameter
        ModelState(model).load_state_dict(other.state_dict())
        drift = max(drift, (model(x) - other(x)).abs().max().item())
    out["forward_after_shards_changed"] = drift


def fsdp_worker(rank: int) -> dict:
    lockstep.init_distributed()
    size = dist.get_world_size()
    out: dict = {}
    _check_different_models(rank, size, out)
    _check_freeze_after_shard(rank, size, out)
    _check_recomputed_blocks(rank, size, out)
    _check_adamw(rank, size, out, "adamw")
    _check_adamw(rank, size, out, "adamw_frozen", freeze=True)
    _check_adamw(rank, size, out, "adamw_keep", reshard_after_forward=False)
    _check_no_sync(rank, size, out)
    _check_without_tensor_collectives(rank, size, out)
    _check_clip(rank, size, out)
    _check_mixed_precision(rank, size, out)
    _check_forward_after_shards_changed(rank, size, out)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_equivalence_with_one_process(world):
    outs = lockstep.spawn(fsdp_worker, world, timeout=120)
    for out in outs:
        for key in ("adamw", "adamw_frozen", "adamw_keep", "adamw_fallback", "no_sync",
                    "freeze_after_shard", "recomputed", "forward_after_shards_changed"):
            assert out[key] < TOL, (key, out[key])
        assert out["clip"] < TOL, out["clip"]
        # both blocks' reduce-scatters were in flight while backward went on (overlap)
        assert out["adamw_in_flight"] == 2, out["adamw_in_flight"]
        assert out["frozen_grad_is_none"] and out["no_sync_no_grad"] and out["clip_clipped"]
        assert out["freeze_after_shard_grads"]
        last = len(outs) - 1
        assert (f"fully_shard: rank {last} holds different parameters than rank 0: parameter "
                f"'0.weight' has shape [6, 4], rank 0 has [4, 4]") in out["different_models"]
        assert out["clip_norm"] < TOL and out["clip_params_norm"] < TOL, out
        # bf16 compute: same roundings as the reference; fp32 sums in another order.
        assert out["mp"] < 1e-4 < out["mp_vs_fp32"], (out["mp"], out["mp_vs_fp32"])
        assert out["mp_shard_dtype"] == "torch.float32" and out["mp_grad_dtype"] == "torch.float32"


def hybrid_worker(rank: int) -> dict:
    """2 × 2: shard inside {0, 1} and {2, 3}, all-reduce across {0, 2} and {1, 3}."""
    lockstep.init_distributed()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (replicate_groups[rank % 2], shard_groups[rank // 2])
    out: dict = {}
    _check_adamw(rank, 4, out, "hybrid", group=pair)
    _check_clip_hybrid(rank, out, pair)
    try:
        lockstep.fully_shard(_model(), group=(pair[0], dist.group.WORLD))
    except ValueError as exc:
        out["mismatch"] = str(exc)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["mesh_groups"] = [dist.get_process_group_ranks(g) for g in mesh_groups(mesh)]
    out["pair_groups"] = [dist.get_process_group_ranks(g) for g in (pair[1], pair[0])]
    return out


def _check_clip_hybrid(rank: int, out: dict, pair: tuple) -> None:
    ref, model = _model(), _model()
    _shard(model, group=pair)
    x, y = _batches(1)[0]
    _loss(ref, x, y).backward()
    _loss(model, _mine(x, rank, 4), _mine(y, rank, 4)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    out["hybrid_clip_norm"] = abs(clip_grad_norm_(model, 0.1).item() - ref_norm.item())


@pytest.mark.multirank
def test_hybrid_two_by_two_equals_one_process():
    for out in lockstep.spawn(hybrid_worker, 4, timeout=120):
        assert out["hybrid"] < TOL, out["hybrid"]
        assert out["hybrid_clip_norm"] < TOL
        assert "does not cover the world of 4" in out["mismatch"]
        assert out["mesh_groups"] == out["pair_groups"]  # a 2-D mesh means the same layout


def test_torchs_arguments_are_taken_at_their_defaults_and_refused_otherwise():
    """A script written for torch's fully_shard passes mesh=, torch's MixedPrecisionPolicy and
    OffloadPolicy(); what lockstep cannot do is refused, naming it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    model = lockstep.fully_shard(_model(), mp_policy=TorchPolicy(reduce_dtype=torch.float64),
                                 offload_policy=OffloadPolicy(), ignored_params=set())
    assert _unit(model).mp_policy == lockstep.MixedPrecisionPolicy(reduce_dtype=torch.float64)
    with pytest.raises(ValueError, match="give group= or torch's mesh=, not both"):
        lockstep.fully_shard(_model(), group=object(), mesh=object())
    with pytest.raises(NotImplementedError, match="offload_policy=CPUOffloadPolicy"):
        lockstep.fully_shard(_model(), offload_policy=CPUOffloadPolicy())
    with pytest.raises(NotImplementedError, match="ignored_params"):
        lockstep.fully_shard(_model(), ignored_params={_model().head.weight})
    with pytest.raises(NotImplementedError, match="output_dtype"):
        lockstep.fully_shard(_model(), mp_policy=TorchPolicy(output_dtype=torch.float32))


def test_a_shard_pickles_and_copies_without_its_unit():
    """The shard carries its unit (for clip_grad_norm_ over model.parameters()); a pickle or a
    copy of the parameter itself must not try to take the unit (modules, groups) along."""
    import io

    from lockstep.fsdp.registry import owner_of

    model = _shard(_model())
    param = next(model.parameters())
    assert owner_of(param) is _unit(model)
    buffer = io.BytesIO()
    torch.save(param, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded, param) and owner_of(loaded) is None
    assert owner_of(copy.deepcopy(param)) is None
    with pytest.raises(ValueError, match="none of the parameters given is a shard"):
        clip_grad_norm_(_model().parameters(), 1.0)


def test_optimizer_groups_by_dimension_split_the_sharded_model_as_the_plain_one():
    """nanoGPT gives weight decay to p.dim() >= 2 only (timm: none to p.ndim <= 1). The shards
    keep their parameters' dimensions, so the same groups form and the run equals the plain
    one (with 1-D shards every parameter fell in the no-decay group, silently)."""

    def groups(model: nn.Module) -> list[dict]:
        params = list(model.parameters())
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    ref, model = _model(), _shard(_model())
    assert [len(g["params"]) for g in groups(model)] == [len(g["params"]) for g in groups(ref)]
    ref_opt, opt = torch.optim.AdamW(groups(ref), lr=0.01), torch.optim.AdamW(groups(model), lr=0.01)
    _train_both(ref, ref_opt, model, opt, 0, 1, steps=3)
    assert _diff(model, ref) < TOL


def test_torchs_mixed_precision_fields_in_torchs_order_and_mesh_groups_exported():
    """output_dtype was an unknown argument (TypeError) until 2026-11-29, though the docs
    promised the NotImplementedError torch's own policy gets; mesh_groups was documented in
    lockstep.fsdp but not importable from it."""
    from lockstep.fsdp import mesh_groups  # noqa: F401

    policy = lockstep.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
        torch.bfloat16, torch.float32, None)
    with pytest.raises(NotImplementedError, match="output_dtype=torch.float32"):
        lockstep.MixedPrecisionPolicy(output_dtype=torch.float32)
