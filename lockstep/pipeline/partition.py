"""Splitting a model into pipeline stages: by parameter count, by measured time, or as given.

A model is a sequence of layers (an ``nn.Sequential``); a stage is a run of consecutive layers.
Balancing picks the cut points that make the heaviest stage as light as possible, because the
slowest (or largest) stage sets the pace of the whole pipeline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "Balance",
    "SequentialStage",
    "balanced_sizes",
    "measure_layer_times",
    "parameter_counts",
    "shared_across_stages",
    "split_layers",
    "stage_sizes",
]

# "params", "time", or the number of layers of each stage, e.g. [2, 3].
Balance = str | Sequence[int]


def balanced_sizes(weights: Sequence[float], num_stages: int) -> list[int]:
    """Cut ``weights`` into ``num_stages`` consecutive non-empty runs minimising the heaviest run.

    Args:
        weights: the cost of each layer (parameters, seconds...), all non-negative.
        num_stages: how many runs to make.

    Returns:
        The length of each run, in order; they sum to ``len(weights)``.

    Raises:
        ValueError: more stages than layers, or a negative weight.

    Example::

        >>> balanced_sizes([4, 1, 1, 1, 1], 2)
        [1, 4]
    """
    n = len(weights)
    if num_stages < 1:
        raise ValueError(f"the number of stages must be at least 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(
            f"cannot split {n} layers into {num_stages} stages: every stage needs at least one "
            f"layer. Use at most {n} stages, or split the model into more, smaller layers."
        )
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be non-negative, got {list(weights)}")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[k][i]: the lightest heaviest-run for the first i layers in k runs (linear partition).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def parameter_counts(layers: Sequence[nn.Module]) -> list[int]:
    """Number of parameter elements of each layer (shared parameters counted where first seen)."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        count = 0
        for param in layer.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        counts.append(count)
    return counts


def shared_across_stages(stages: Sequence[nn.Module]) -> tuple[str, int, str, int] | None:
    """The first parameter that two stages both use, as ``(name, stage, other name, stage)``.

    A parameter shared by layers that land on different stages (tied embedding and output
    weights) cannot stay tied once each stage has its own copy on its own rank or device.
    """
    owner: dict[int, tuple[str, int]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            first = owner.setdefault(id(param), (name, index))
            if first[1] != index:
                return first[0], first[1], name, index
    return None


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def measure_layer_times(
    layers: Sequence[nn.Module], sample: Any, repeats: int = 3
) -> list[float]:
    """Seconds each layer takes for forward and backward on ``sample``, the best of ``repeats``.

    The sample flows through the layers in order, so each is timed on its real input shape.
    The layers' buffers and gradients and the CPU and CUDA random number generators are left
    as they were (before 2026-11-29 timing updated BatchNorm statistics and advanced the RNG).

    Raises:
        RuntimeError: a layer fails on the output of the one before, naming both.
    """
    # Timing runs the layers for real: keep the model and the random number generators as
    # they were (BatchNorm statistics, dropout's draws, gradients already there).
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    buffers = list({id(b): b for layer in layers for b in layer.buffers()}.values())
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in buffers]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    for param in params:
        param.grad = None  # timing's backward would add into gradients already there
    try:
        return _time_layers(layers, sample, repeats)
    finally:
        with torch.no_grad():
            for buf, value in zip(buffers, saved_buffers):
                buf.copy_(value)
        for param, grad in zip(params, saved_grads):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _time_layers(layers: Sequence[nn.Module], sample: Any, repeats: int) -> list[float]:
    times = []
    inputs = tuple(t.detach() for t in _as_tuple(sample))
    for index, layer in enumerate(layers):
        best = float("inf")
        for _ in range(max(1, repeats)):
            args = tuple(
                t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t
                for t in inputs
            )
            start = time.perf_counter()
            try:
                out = _as_tuple(layer(*args))
            except Exception as exc:
                shapes = [tuple(t.shape) for t in args if torch.is_tensor(t)]
                raise RuntimeError(
                    f"layer {index} ({type(layer).__name__}) failed on inputs of shapes {shapes} "
                    f"while timing layers for balance='time': {exc}"
                ) from exc
            grads = [t for t in out if torch.is_tensor(t) and t.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
            best = min(best, time.perf_counter() - start)
        times.append(best)
        inputs = tuple(t.detach() if torch.is_tensor(t) else t for t in out)
    return times


def stage_sizes(
    layers: Sequence[nn.Module],
    num_stages: int,
    balance: Balance = "params",
    sample: Any = None,
) -> list[int]:
    """How many consecutive layers each stage gets.

    Args:
        layers: the model's layers in order.
        num_stages: how many stages to make.
        balance: ``"params"`` (equal parameter counts), ``"time"`` (equal measured forward and
            backward time on ``sample``) or the number of layers of each stage, e.g. ``[2, 3]``.
        sample: an input batch, needed for ``balance="time"``.

    Raises:
        ValueError: more stages than layers, an unknown balance, or sizes that do not add up.
    """
    n = len(layers)
    if isinstance(balance, str):
        if balance == "params":
            counts = parameter_counts(layers)
            # Parameter-free layers (activations) still cost a little; a tiny weight keeps the
            # split from piling them all on one stage.
            return balanced_sizes([c + 1e-3 for c in counts], num_stages)
        if balance == "time":
            if sample is None:
                raise ValueError("balance='time' needs sample_input: a batch to time the layers on")
            if num_stages > n:
                return balanced_sizes([0.0] * n, num_stages)  # raises the clear error
            return balanced_sizes(measure_layer_times(layers, sample), num_stages)
        raise ValueError(
            f"unknown balance {balance!r}: use 'params', 'time', or a list of layers per stage"
        )
    sizes = [int(s) for s in balance]
    if len(sizes) != num_stages:
        raise ValueError(f"balance {sizes} gives {len(sizes)} stages, but there are {num_stages}")
    if any(s < 1 for s in sizes) or sum(sizes) != n:
        raise ValueError(
            f"balance {sizes} must give every stage at least one layer and add up to the "
            f"model's {n} layers"
        )
    return sizes


class SequentialStage(nn.Sequential):
    """A stage cut from an ``nn.Sequential``: its first layer gets what it got in the model.

    A stage receives what crossed the boundary as separate tensors; where the layer before the
    cut returned a tuple, the layer after it takes that tuple as its one argument, as it did
    inside the model.
    """

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            x = layer(x)
        return x


def split_layers(
    module: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    balance: Balance | None = "params",
    sample: Any = None,
) -> list[nn.Module]:
    """Split a model into ``num_stages`` stage modules.

    Args:
        module: an ``nn.Sequential`` to cut, or a list (or ``nn.ModuleList``) of ready-made
            stages, used as they are.
        num_stages: how many stages to make.
        balance: see :func:`stage_sizes`; ignored for a list of stages.
        sample: an input batch for ``balance="time"``.

    Returns:
        One module per stage: a ``nn.Sequential`` of the stage's layers (sharing the original
        layer objects), or the given stage.

    Raises:
        ValueError: a list of stages whose length is not ``num_stages``, or see :func:`stage_sizes`.

    Example::

        stages = split_layers(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 2)
    """
    if isinstance(module, nn.Sequential):
        named = list(module.named_children())
        sizes = stage_sizes([m for _, m in named], num_stages, balance or "params", sample)
        stages: list[nn.Module] = []
        start = 0
        for size in sizes:
            # Keep the original layer names so a stage's state_dict keys match the model's.
            stages.append(SequentialStage(OrderedDict(named[start:start + size])))
            start += size
        return stages
    if isinstance(module, (list, tuple, nn.ModuleList)):
        explicit = list(module)
        if len(explicit) != num_stages:
            raise ValueError(
                f"got {len(explicit)} explicit stages, but the pipeline has {num_stages} "
                "(devices or ranks); give one stage per device or rank"
            )
        if not all(isinstance(s, nn.Module) for s in explicit):
            raise ValueError("every explicit stage must be an nn.Module")
        return explicit
    raise ValueError(
        f"a pipeline needs an nn.Sequential or a list of stage modules, got {type(module).__name__}"
    )
