"""DDP gradients where torch's DDP is the calibration: each case runs lockstep's DDP, torch's own
DistributedDataParallel (on a copy of the same model, in the same gloo world) and a single-process
full-batch reference, and asserts lockstep equals the reference and matches torch — the same
gradient, or an error exactly where torch raises one (issue 10), and bitwise-equal resumes at
three and four workers (issue 11, item 1).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import lockstep

pytestmark = pytest.mark.multirank
TOL = 1e-5
ITERS = 3


# ---- models --------------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """A block under reentrant checkpointing: ``where`` puts it in the middle, last, or twice last."""

    def __init__(self, where: str = "last", partly_unused: bool = False) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)  # inside the block; unused there when partly_unused
        self.where, self.partly_unused = where, partly_unused

    def block(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(h))
        return h if self.partly_unused else torch.tanh(self.spare(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "middle":
            return self.l2(checkpoint(self.block, self.l0(x), use_reentrant=True))
        h = self.l2(self.l0(x))  # the block last: its gradients arrive first, in a nested backward
        for _ in range(2 if self.where == "twice" else 1):
            h = checkpoint(self.block, h, use_reentrant=True)
        return h


class Gate(torch.autograd.Function):
    """``x * w``; backward gives ``w`` no gradient (None) when ``keep`` is False."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, (grad.sum(0) if ctx.keep else None), None


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.head = nn.Parameter(torch.ones(4)), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, keep: bool) -> torch.Tensor:
        return self.head(Gate.apply(x, self.w, keep))


class Bag(nn.Module):
    """A sparse embedding, alone or beside dense layers."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 2) if dense else None

    def forward(self, tokens: torch.Tensor, use_embedding: bool = True) -> torch.Tensor:
        h = self.emb(tokens).sum(1) if use_embedding else torch.ones(tokens.shape[0], 4)
        return self.head(h) if self.head is not None else h


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return (self.b if branch == "b" else self.c)(self.trunk(x))


def _critic() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


# ---- harness --------------------------------------------------------------------------------
def _data(it: int, rank: int, shape: tuple = (2, 4)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * it + rank))


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _same(a: list, b: list, tol: float = TOL) -> bool:
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None:
            if x.is_sparse != y.is_sparse:
                return False
            if not torch.allclose(x.to_dense(), y.to_dense(), atol=tol, rtol=0):
                return False
    return True


def _run(build: Callable[[], nn.Module], loss: Callable, kwargs: dict, hook: Any = None,
         reference: bool = True, torch_too: bool = True) -> dict:
    """Gradients per iteration for lockstep, torch (or the error each raised) and the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = build()
    out: dict[str, Any] = {}
    wrappers = [("lockstep", lockstep.DistributedDataParallel), ("torch", TorchDDP)]
    for name, cls in wrappers[: 2 if torch_too else 1]:
        model = copy.deepcopy(base)
        ddp = cls(model, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        out[name] = []
        for it in range(ITERS):
            model.zero_grad()
            try:
                loss(ddp, rank, it).backward()
            except RuntimeError as exc:
                out[name] = f"RuntimeError at iteration {it}: {exc}"
                break
            out[name].append(_grads(model))
        dist.barrier()
    if reference:
        ref = copy.deepcopy(base)
        out["reference"] = []
        for it in range(ITERS):
            ref.zero_grad()
            (sum(loss(ref, r, it) for r in range(world)) / world).backward()
            out["reference"].append(_grads(ref))
    return out


def _agree(result: dict, tol: float = TOL) -> bool:
    """lockstep == reference (when there is one) and == torch, every iteration."""
    mine, theirs = result["lockstep"], result.get("torch", result["lockstep"])
    if isinstance(mine, str) or isinstance(theirs, str):
        return False
    pairs = list(zip(mine, theirs)) + list(zip(mine, result.get("reference", mine)))
    return len(mine) == ITERS and all(_same(a, b, tol) for a, b in pairs)


def _both_raise(result: dict, theirs_says: str, mine_says: str) -> bool:
    mine, theirs = result["lockstep"], result["torch"]
    return (isinstance(mine, str) and isinstance(theirs, str)
            and mine.split(":")[0] == theirs.split(":")[0]  # same iteration
            and theirs_says in theirs and mine_says in mine)


def _mse(model: nn.Module, rank: int, it: int) -> torch.Tensor:
    return (model(_data(it, rank)) - 1).pow(2).mean()


# ---- the cases, all in one world of two ------------------------------------------------------
def _bag_loss(model: nn.Module, rank: int, it: int, use_embedding: bool = True) -> torch.Tensor:
    tokens = torch.randint(0, 12, (2, 3), generator=torch.Generator().manual_seed(10 * it + rank))
    return model(tokens, use_embedding).pow(2).mean()


def _gated_loss(model: nn.Module, rank: int, it: int) -> torch.Tensor:
    return model(_data(it, rank), rank == 0).pow(2).mean()


def _critic_loss(model: nn.Module, rank: int, it: int) -> torch.Tensor:
    """Two forwards (real, fake) before one backward: the GAN / contrastive pattern."""
    return model(_data(it, rank, (4, 4))).mean() - model(_data(it, rank + 50, (4, 4))).mean()


CASES: dict[str, Callable[[], Any]] = {
    # 1. static_graph: a block checkpointed twice; unused parameters inside it.
    "static_twice": lambda: _run(lambda: Checkpointed("twice"), _mse, {"static_graph": True}),
    "static_twice_partly_unused": lambda: _run(
        lambda: Checkpointed("twice", partly_unused=True), _mse, {"static_graph": True}),
    # 2. reentrant checkpointing once per forward; errors exactly where torch raises.
    "reentrant_last": lambda: _run(lambda: Checkpointed("last"), _mse, {}),
    "reentrant_middle": lambda: _run(lambda: Checkpointed("middle"), _mse,
                                     {"gradient_as_bucket_view": False}),
    "reentrant_twice": lambda: _run(lambda: Checkpointed("twice"), _mse, {}, reference=False),
    "reentrant_find_unused": lambda: _run(lambda: Checkpointed("last", partly_unused=True), _mse,
                                          {"find_unused_parameters": True}, reference=False),
    "static_graph_changed": lambda: _run(
        Branches, lambda m, r, it: m(_data(it, r), "c" if it < 2 else "b").sum(),
        {"static_graph": True}, reference=False),
    # 4. a gradient undefined on rank 1 only.
    "undefined_find_unusedFalse": lambda: _run(Gated, _gated_loss, {"find_unused_parameters": False}),
    "undefined_find_unusedTrue": lambda: _run(Gated, _gated_loss, {"find_unused_parameters": True}),
    # 5. two forwards, one backward, BatchNorm and broadcast buffers.
    "two_forwards_bn": lambda: _run(_critic, _critic_loss, {"broadcast_buffers": True}),
    # 6. no_sync + find_unused: branch b used on rank 0 under no_sync only.
    "no_sync_find_unused": lambda: {
        name: _no_sync_case(cls, view)
        for name, cls, view in (("lockstep", lockstep.DistributedDataParallel, True),
                                ("lockstep_copy", lockstep.DistributedDataParallel, False),
                                ("torch", TorchDDP, True))},
}
# 3. sparse gradients (torch's DDP fails when one rank leaves a sparse embedding unused).
CASES["sparse_unused_on_rank1"] = lambda: _run(
    lambda: Bag(True), lambda m, r, it: _bag_loss(m, r, it, use_embedding=r == 0),
    {"find_unused_parameters": True}, torch_too=False)
# Sparse gradients: alone and beside dense layers, bucket views on and off, with a comm hook.
for _dense in (False, True):
    for _view in (True, False):
        for _hook_name, _hook in (("no_hook", None), ("hook", default_hooks.allreduce_hook)):
            CASES[f"sparse_dense{_dense}_view{_view}_{_hook_name}"] = (
                lambda d=_dense, v=_view, h=_hook: _run(
                    lambda: Bag(d), _bag_loss, {"gradient_as_bucket_view": v}, hook=h))


def _cases(rank: int, names: list[str] | None = None) -> dict:
    lockstep.init_distributed()
    return {name: CASES[name]() for name in (names or list(CASES))}


def _no_sync_case(cls: type, view: bool) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Branches()
    ref = copy.deepcopy(model)
    ddp = cls(model, find_unused_parameters=True, gradient_as_bucket_view=view)
    with ddp.no_sync():
        ddp(_data(0, rank), "b" if rank == 0 else "c").sum().backward()
    ddp(_data(1, rank), "c").sum().backward()
    # The reference: rank 0's micro-batch took branch b, everyone's second took c.
    (sum(ref(_data(0, r), "b" if r == 0 else "c").sum() + ref(_data(1, r), "c").sum()
         for r in range(world)) / world).backward()
    grads = _grads(model)
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    return [all(_same(g, gathered[0], 0.0) for g in gathered), _same(grads, _grads(ref))] + grads


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return lockstep.spawn(_cases, 2, timeout=240)


AGREE = ["sparse_unused_on_rank1", "static_twice", "static_twice_partly_unused", "reentrant_last", "reentrant_middle",
         "undefined_find_unusedFalse", "undefined_find_unusedTrue", "two_forwards_bn"] + [
    f"sparse_dense{d}_view{v}_{h}" for d in (False, True) for v in (True, False) for h in ("no_hook", "hook")]


@pytest.mark.parametrize("case", AGREE)
def test_same_gradient_as_torch_and_reference(world2: list[dict], case: str) -> None:
    for rank, result in enumerate(world2):
        assert _agree(result[case]), f"rank {rank}, {case}: lockstep {str(result[case]['lockstep'])[:300]}"


RAISE = {
    "reentrant_twice": ("Expected to mark a variable ready only once", "use_reentrant=False"),
    "reentrant_find_unused": ("Expected to mark a variable ready only once", "use_reentrant=False"),
    "static_graph_changed": ("graph has changed", "the graph changed between iterations"),
}


@pytest.mark.parametrize("case", list(RAISE))
def test_error_exactly_where_torch_raises(world2: list[dict], case: str) -> None:
    for result in world2:
        assert _both_raise(result[case], *RAISE[case]), (result[case]["lockstep"], result[case]["torch"])


def test_sparse_gradient_stays_sparse(world2: list[dict]) -> None:
    for result in world2:
        for case in AGREE:
            if case.startswith("sparse_dense"):
                assert result[case]["lockstep"][0][0].is_sparse


def test_no_sync_with_find_unused_gives_every_rank_torchs_gradient(world2: list[dict]) -> None:
    for result in world2:
        case = result["no_sync_find_unused"]
        theirs = case["torch"]
        for name in ("lockstep", "lockstep_copy"):
            mine = case[name]
            assert mine[0] and mine[1], f"{name}: ranks differ or differ from the reference"
            assert _same(mine[2:], theirs[2:]) and all(g is not None for g in mine[2:])


# ---- bitwise resume (issue 11, item 1) ---------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 29, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


STEPS, RESUME_AT = 6, (1, 2, 4)


def _train(state: dict | None, start: int, stop: int, torch_ddp: bool = False) -> tuple[dict, dict]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    if state is not None:
        model.load_state_dict(state["model"])
    cls = TorchDDP if torch_ddp else lockstep.DistributedDataParallel
    ddp = cls(model, bucket_cap_mb=0.004)  # a dozen buckets: the layout matters
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)  # Adam would turn noise-level
    # gradients (the attention key bias) into full steps and compare noise with torch, not DDP
    if state is not None:
        opt.load_state_dict(state["opt"])
    snapshots = {}
    for step in range(start, stop):
        tokens = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        snapshots[step + 1] = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    return snapshots[stop], snapshots


def _resume_world(rank: int) -> dict:
    lockstep.init_distributed()
    final, snapshots = _train(None, 0, STEPS)
    resumed = {k: _train(snapshots[k], k, STEPS)[0]["model"] for k in RESUME_AT}
    theirs = _train(None, 0, STEPS, torch_ddp=True)[0]["model"]
    return {
        "bitwise": {k: all(torch.equal(final["model"][n], v) for n, v in s.items()) for k, s in resumed.items()},
        "torch_close": all(torch.allclose(final["model"][n], v, atol=1e-4) for n, v in theirs.items()),
    }


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_resume_is_bitwise_equal_to_uninterrupted_run(world: int) -> None:
    for rank, result in enumerate(lockstep.spawn(_resume_world, world, timeout=240)):
        assert all(result["bitwise"].values()), f"rank {rank}: resumed after step k differs: {result['bitwise']}"
        assert result["torch_close"], f"rank {rank}: differs from torch's DDP beyond float tolerance"
