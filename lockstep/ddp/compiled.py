"""DistributedDataParallel under ``torch.compile``: the graph split at lockstep's bucket boundaries.

``torch.compile`` turns a model's backward into one autograd node, so every gradient becomes ready
only when the whole compiled backward ends: the bucket all-reduces that eager mode starts during
backward all start at its end, and none overlaps computation. So lockstep compiles the module in
pieces. A Dynamo backend (:class:`BucketSplitter`) walks the traced FX graph from its end, as
backward does, and cuts it where a bucket's last gradient is complete; each piece is compiled
with the backend the user chose and becomes its own autograd node. When a piece's backward ends,
its parameters' gradients accumulate, the reducer's hooks fire and that bucket's all-reduce starts
while the earlier pieces' backward runs (torch's DDP splits its graphs the same way; Li et al.,
"PyTorch Distributed", VLDB 2020, for why buckets overlap backward).

Buckets and pieces come from one rule. Before the reducer's layout is fixed (its first
synchronised backward), the splitter proposes the graph's gradient order, each parameter's first
use in forward, last first, and the reducer builds its buckets in that order at that backward
(rank 0's, broadcast, as a recorded order would be), so the pieces cut where those buckets end.
Once the layout is fixed, the splitter follows the reducer's buckets.

How the pieces are reached: the wrapper's ``forward`` is skipped by Dynamo (not traced, so no
graph break: it runs as Python, as torch's DDP forward does) and runs the module through a twin
compiled with this backend around the user's. The user's backend is read from the
``torch.compile`` context the forward runs in, or from a module compiled before wrapping.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from lockstep._torch_compat_compile import compile_backend_in_effect, compiled_module_backend

__all__ = [
    "BucketSplitter",
    "CompiledTwin",
    "active_backend",
    "assign_pieces",
    "first_uses",
    "gradient_order",
    "param_nodes",
]

logger = logging.getLogger(__name__)

# ``plan(order)``: the buckets (lists of parameters, launch order) for a backward that finishes
# gradients in ``order``; DistributedDataParallel.plan_buckets is one.
BucketPlan = Callable[[Sequence[nn.Parameter]], list[list[nn.Parameter]]]


def param_nodes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, nn.Parameter]:
    """Graph inputs (and attributes) that are trainable parameters, with the parameter itself.

    Dynamo lifts a module's parameters into graph inputs and hands the backend the tensors
    themselves, so a parameter is recognised by identity.
    """
    found: dict[fx.Node, nn.Parameter] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter) and value.requires_grad:
            found[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                found[node] = value
    return found


def first_uses(gm: fx.GraphModule, params: dict[fx.Node, nn.Parameter]) -> dict[fx.Node, list[nn.Parameter]]:
    """For each compute node, the parameters it is the first (in forward order) to use."""
    seen: set[int] = set()
    firsts: dict[fx.Node, list[nn.Parameter]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        for arg in node.all_input_nodes:
            p = params.get(arg)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                firsts.setdefault(node, []).append(p)
    return firsts


def gradient_order(firsts: dict[fx.Node, list[nn.Parameter]]) -> list[nn.Parameter]:
    """Parameters in the order backward finishes their gradients: first use in forward, last first.

    A parameter used twice (tied weights) is final only after the backward of its first use.
    """
    return [p for node in reversed(list(firsts)) for p in firsts[node]]


def assign_pieces(
    gm: fx.GraphModule,
    firsts: dict[fx.Node, list[nn.Parameter]],
    buckets: Sequence[Sequence[nn.Parameter]],
    uses: Collection[fx.Node] = (),
) -> dict[fx.Node, int]:
    """Piece of every compute node (0 first in forward): a piece ends where a bucket completes.

    Walking backward, a bucket is complete at the node holding the first use of its last
    parameter still to come; the piece closes there, so a bucket's gradients are all final
    when the backward of the pieces holding them ends. The cut itself is placed as late in
    forward as it can go: operations that use no parameter and follow the previous piece's
    last use of one (an activation, a dropout) join the later piece, so the tensor crossing
    the cut is a layer's raw output. Their backward is cheap and, kept with the operation that
    consumes them, the compiler sees an activation together with the layer that reads it: cut
    after a ReLU instead, inductor saves the ReLU's mask for backward as an extra bool tensor,
    which measured 0.6 ms per piece on a CPU (an 1024-wide MLP, batch 64), a fifth of the
    step. Parameters a bucket has outside this graph do not hold it open. A leading stretch
    without parameters joins the next piece.

    Args:
        gm: the traced graph.
        firsts: :func:`first_uses` of the graph.
        buckets: the buckets, in launch order.
        uses: the graph's parameter nodes (:func:`param_nodes`): any use of one counts.
    """
    in_graph = {id(p) for ps in firsts.values() for p in ps}
    bucket_of = {id(p): b for b, members in enumerate(buckets) for p in members}
    left = [sum(id(p) in in_graph for p in members) for members in buckets]
    params = set(uses)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    from_end: dict[fx.Node, int] = {}
    piece, has_params, closing = 0, False, False
    for node in reversed(nodes):
        if closing and (node in firsts or any(a in params for a in node.all_input_nodes)):
            piece, has_params, closing = piece + 1, False, False  # the cut falls after this node
        from_end[node] = piece
        for p in firsts.get(node, []):
            has_params = True
            b = bucket_of.get(id(p))
            if b is not None:
                left[b] -= 1
                closing = closing or left[b] == 0
    last = piece if has_params or piece == 0 else piece - 1
    return {node: last - min(p, last) for node, p in from_end.items()}


class BucketSplitter:
    """A Dynamo backend: split the graph at the buckets ``plan`` gives, compile pieces with ``backend``.

    Args:
        plan: the bucket seam of the DDP wrapper (:meth:`DistributedDataParallel.plan_buckets`).
        backend: the backend each piece is compiled with (what the user gave ``torch.compile``).
    """

    def __init__(self, plan: BucketPlan, backend: Any) -> None:
        self.plan = plan
        self.backend = backend
        # Per graph compiled: the parameters whose gradients each piece finishes (tests, logs).
        self.pieces: list[list[list[nn.Parameter]]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        params = param_nodes(gm, example_inputs)
        firsts = first_uses(gm, params)
        buckets = self.plan(gradient_order(firsts)) if firsts else []
        where = assign_pieces(gm, firsts, buckets, params)
        count = max(where.values(), default=0) + 1
        self.pieces.append([[p for node, ps in firsts.items() if where[node] == k for p in ps]
                            for k in range(count)])
        logger.debug("lockstep compile: %d buckets, graph cut into %d pieces", len(buckets), count)
        if count == 1:
            return self.backend(gm, example_inputs)  # nothing to split: as Dynamo would
        split = split_module(gm, None, lambda node: where[node])  # type: ignore[arg-type]
        for index, (name, child) in enumerate(list(split.named_children())):
            assert isinstance(child, fx.GraphModule)  # split_module makes every piece one
            # Each piece is compiled on its own: its backward is its own autograd node.
            setattr(split, name, torch.compile(_Piece(child, index), backend=self.backend))
        return split


class _Piece(nn.Module):
    """A piece of the split graph, behind a forward of its own for Dynamo to start from.

    Compiled directly, a GraphModule is entered through torch.fx's own call path, which Dynamo
    skips together with the generated forward it calls; from a plain forward it is traced.
    """

    def __init__(self, graph: fx.GraphModule, index: int = 0) -> None:
        super().__init__()
        # A forward generated lazily, on first call, is also one Dynamo will not trace into.
        getattr(graph, "real_recompile", lambda: None)()
        self.graph = graph
        # Dynamo caches compiled frames per code object, at most ``recompile_limit`` (8) each:
        # pieces sharing one forward would leave the ninth and later ones uncompiled. Each
        # piece gets a forward of its own code.
        shared = type(self).forward
        code = shared.__code__.replace(co_name=f"forward_piece_{index}")
        own = types.FunctionType(code, shared.__globals__, code.co_name, shared.__defaults__,
                                 shared.__closure__)
        self.forward = types.MethodType(own, self)  # type: ignore[method-assign]

    def forward(self, *args: Any) -> Any:
        return self.graph(*args)


# Called from the wrapper's forward, which Dynamo skips but whose callees it would trace: this
# frame is skipped too (it reads the compile context, which tracing would break on).
@torch.compiler.disable(recursive=False)
def active_backend(module: nn.Module) -> tuple[Any, nn.Module] | None:
    """The backend the module is being compiled with, and the module to compile; None: eager.

    A module compiled before wrapping (``DistributedDataParallel(torch.compile(net))``) carries
    its backend; otherwise the ``torch.compile`` context this call runs in gives it.
    """
    # torch keeps both in private places (a compiled module's context, the frame-evaluation
    # callback chain): lockstep._torch_compat reads them.
    compiled = compiled_module_backend(module)
    if compiled is not None:
        return compiled
    backend = compile_backend_in_effect()
    return None if backend is None else (backend, module)


class CompiledTwin:
    """Runs a DDP module; under ``torch.compile``, through its bucket-split compiled twin.

    Args:
        module: the wrapped module (possibly already ``torch.compile``-d).
        plan: the wrapper's bucket seam.
    """

    def __init__(self, module: nn.Module, plan: BucketPlan) -> None:
        self.module = module
        self.plan = plan
        self._twins: dict[int, tuple[Any, Callable[..., Any], BucketSplitter]] = {}

    def __call__(self, found: tuple[Any, nn.Module] | None, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module, split-compiled with ``found``'s backend (see :func:`active_backend`)."""
        if found is None:
            return self.module(*inputs, **kwargs)
        backend, target = found
        if id(backend) not in self._twins:
            splitter = BucketSplitter(self.plan, backend)
            # The twin is held here, not registered as a submodule: no second set of state keys.
            # The backend is held too, so that its id is not reused while the entry lives.
            self._twins[id(backend)] = (backend, torch.compile(target, backend=splitter), splitter)
        return self._twins[id(backend)][1](*inputs, **kwargs)

    def splitters(self) -> list[BucketSplitter]:
        """The splitters built so far (one per backend), e.g. to inspect the pieces."""
        return [t[2] for t in self._twins.values()]
