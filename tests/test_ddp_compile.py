"""DistributedDataParallel under torch.compile: the graph split at bucket boundaries (compiled.py).

Pure logic first (the split of one traced graph, no processes), then worlds of 2 and 3 on gloo:
compiled lockstep (the wrapper compiled, or a model compiled before wrapping) against eager
lockstep, torch's compiled DDP and a single-process reference on the full batch; no graph break;
and overlap: a bucket's all-reduce starts before the backward of the model's first layer.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.ddp.comm_hooks import allreduce_hook
from lockstep.ddp.compiled import (
    BucketSplitter,
    assign_pieces,
    first_uses,
    gradient_order,
    param_nodes,
)

STEPS = 3
WIDTH = 16
LAYERS = 4
TOL = 1e-5


def _mlp() -> nn.Sequential:
    """Bias-free layers: one parameter per layer, so a bucket of one layer is one piece."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 2, bias=False))


LAYER_MB = WIDTH * WIDTH * 4 / 2**20  # a bucket cap of one hidden layer


# ---- the split of one graph (no processes) -----------------------------------------------------
def _split_once(net: nn.Module, plan) -> tuple[BucketSplitter, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    splitter = BucketSplitter(plan, "aot_eager")
    x = torch.randn(3, WIDTH)
    return splitter, torch.compile(net, backend=splitter)(x), net(x)


def test_pieces_end_where_buckets_end():
    net = _mlp()
    proposed: list[list[nn.Parameter]] = []

    def pairs(order):
        proposed.append(list(order))
        return [list(order[i:i + 2]) for i in range(0, len(order), 2)]

    splitter, out, eager = _split_once(net, pairs)
    params = list(net.parameters())
    assert [id(p) for p in proposed[0]] == [id(p) for p in reversed(params)]  # backward's order
    buckets = pairs(proposed[0])
    pieces = splitter.pieces[0]
    assert len(pieces) == 3  # 5 layers in buckets of 2: the first layer alone, then 2 and 2
    assert [{id(p) for p in piece} for piece in reversed(pieces)] == [
        {id(p) for p in b} for b in buckets]
    # Each piece is its own autograd node: the output's backward is a chain of compiled nodes.
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "CompiledFunctionBackward"
    torch.testing.assert_close(out, eager)


def test_more_pieces_than_dynamos_recompile_limit_are_all_compiled():
    # Pieces shared one forward, so one code object: Dynamo compiles at most 8 frames per code
    # object, and until 2026-11-29 the ninth piece and later ran eagerly, without a word.
    layers = []
    for _ in range(11):
        layers += [nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(WIDTH, 2, bias=False))
    splitter, out, eager = _split_once(net, lambda order: [[p] for p in order])
    assert len(splitter.pieces[0]) == 12
    compiled, node = 0, out.grad_fn
    while node is not None:
        compiled += type(node).__name__ == "CompiledFunctionBackward"
        node = next((n for n, _ in node.next_functions if n is not None), None)
    assert compiled == 12
    torch.testing.assert_close(out, eager)


def test_the_cut_falls_after_the_activation():
    """An activation goes with the layer that reads it: what crosses a cut is a layer's output.

    Cut after a ReLU instead, inductor saves the ReLU's mask for backward as an extra tensor,
    measured to cost a fifth of a CPU step (assign_pieces).
    """
    net = _mlp()
    captured: list[tuple[torch.fx.GraphModule, list]] = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(net, backend=capture)(torch.randn(3, WIDTH))
    gm, inputs = captured[0]
    params = param_nodes(gm, inputs)
    firsts = first_uses(gm, params)
    order = gradient_order(firsts)
    where = assign_pieces(gm, firsts, [[p] for p in order], params)
    assert max(where.values()) == LAYERS  # one piece per layer
    for node in gm.graph.nodes:
        if node.op == "output" or node.op == "placeholder":
            continue
        users = [u for u in node.users if u.op != "output"]
        if node in firsts:  # a layer: its piece ends with it or with its activation
            continue
        # an activation: in the piece of the layer that consumes it
        assert all(where[u] == where[node] for u in users), node


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def test_a_tied_weight_is_ready_after_its_first_use():
    net = _Tied()
    seen: list[list[nn.Parameter]] = []

    def one_bucket_each(order):
        seen.append(list(order))
        return [[p] for p in order]

    torch._dynamo.reset()
    splitter = BucketSplitter(one_bucket_each, "aot_eager")
    out = torch.compile(net, backend=splitter)(torch.randint(0, 10, (2, 3)))
    out.sum().backward()
    order = seen[0]
    # The embedding's gradient is complete only after its first use (the lookup) is
    # differentiated, though the head uses the same tensor later in forward.
    assert order[-1] is net.embed.weight and len(order) == 3
    assert net.embed.weight.grad is not None


# ---- worlds of 2 and 3 -----------------------------------------------------------------------
def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 2, generator=g)


def _first_layer_node(out: torch.Tensor, weight: torch.Tensor):
    """The backward node that computes ``weight``'s gradient (the model's first layer)."""
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if getattr(child, "variable", None) is weight:
                return node
            stack.append(child)
    raise AssertionError("the first layer's weight is not in the graph")


def _train(model, net: nn.Sequential, rank: int, launches: list[int] | None) -> list[int]:
    """STEPS steps; returns, per step, the all-reduces launched before the first layer's backward."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    early: list[int] = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        out = model(x)
        if launches is not None:
            first = net[0]
            assert isinstance(first, nn.Linear)
            node = _first_layer_node(out, first.weight)
            node.register_prehook(functools.partial(_count_at, launches, len(launches), early))
        F.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    return early


def _count_at(launches: list[int], before: int, early: list[int], grads) -> None:
    early.append(len(launches) - before)


def _counting_hook(launches: list):
    def hook(group, bucket):
        launches.append(bucket.index())
        return allreduce_hook(group, bucket)

    return hook


def _compiled_world(rank: int, backend: str, variants: list[str]) -> dict:
    world = lockstep.init_distributed().world_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out: dict = {"rank": rank}
    for variant in variants:
        torch._dynamo.reset()  # each variant compiles afresh
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        net = _mlp()
        launches: list | None = None
        if variant == "eager":
            model = ddp = lockstep.DistributedDataParallel(net, bucket_cap_mb=LAYER_MB)
        elif variant == "compiled":
            ddp = lockstep.DistributedDataParallel(net, bucket_cap_mb=LAYER_MB)
            launches = []
            ddp.register_comm_hook(ddp.process_group, _counting_hook(launches))
            model = torch.compile(ddp, backend=backend)
        elif variant == "compiled_inner":
            inner = torch.compile(net, backend=backend)
            model = ddp = lockstep.DistributedDataParallel(inner, bucket_cap_mb=LAYER_MB)
            launches = []
            ddp.register_comm_hook(ddp.process_group, _counting_hook(launches))
        else:  # torch's DDP, compiled (its own graph split; its first bucket must fit its cap)
            model = torch.compile(nn.parallel.DistributedDataParallel(net), backend=backend)
        early = _train(model, net, rank, launches)
        out[variant] = {"params": [p.detach().clone() for p in net.parameters()], "early": early,
                        "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks}
        if variant.startswith("compiled"):
            names = {id(p): n for n, p in net.named_parameters()}
            buckets = [[names[id(p)] for p in b] for b in ddp.plan_buckets([])]
            pieces = [[names[id(p)] for p in piece] for piece in ddp.compiled_pieces[-1]]
            out[variant]["buckets"], out[variant]["pieces"] = buckets, pieces
    if rank == 0:  # the reference: one process, every rank's batch at once
        net = _mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(STEPS):
            xs, ys = zip(*(_batch(r, step) for r in range(world)))
            F.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            opt.zero_grad()
        out["reference"] = [p.detach().clone() for p in net.parameters()]
    dist.barrier()
    return out


def _check(results: list[dict], variants: list[str]) -> None:
    reference = results[0]["reference"]
    for r in results:
        for variant in variants:
            for got, want in zip(r[variant]["params"], reference):
                torch.testing.assert_close(got, want, atol=TOL, rtol=TOL, msg=variant)
        for variant in (v for v in variants if v.startswith("compiled")):
            res = r[variant]
            assert res["breaks"] == 0, (variant, res["breaks"])  # none from lockstep
            # The first synchronised backward records (reduces at its end); later ones overlap:
            # every bucket but the first layer's starts before the first layer's backward.
            later = len(res["buckets"]) - 1
            assert later >= 3 and res["early"] == [0] + [later] * (STEPS - 1), res["early"]
            # Buckets and pieces agree: piece k (from the end) finishes exactly bucket k.
            assert [sorted(p) for p in reversed(res["pieces"])] == [sorted(b) for b in res["buckets"]]


ALL = ["eager", "compiled", "compiled_inner", "torch"]


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_compiled_matches_eager_torch_and_one_process(world):
    variants = ALL if world == 2 else ALL[:3]  # torch's compiled DDP once is enough
    results = lockstep.spawn(_compiled_world, world, ("aot_eager", variants), timeout=300)
    _check(results, variants)


@pytest.mark.multirank
def test_inductor_keeps_the_overlap():
    results = lockstep.spawn(_compiled_world, 2, ("inductor", ["compiled"]), timeout=400)
    _check(results, ["compiled"])
