"""Cutting a model into stages: balanced by parameters, by measured time, or as given."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

from lockstep.pipeline.partition import (
    balanced_sizes,
    measure_layer_times,
    parameter_counts,
    split_layers,
    stage_sizes,
)


def _brute_force_best(weights, k):
    """The lightest heaviest-run over every way to cut ``weights`` into ``k`` runs."""
    import itertools

    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("weights,k", [
    ([4, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), ([5, 5, 5, 5], 4),
    ([10, 1, 1, 1, 1, 1, 1, 10], 3), ([0, 0, 7, 0, 0], 2), ([3], 1),
])
def test_balanced_sizes_is_optimal(weights, k):
    sizes = balanced_sizes(weights, k)
    assert len(sizes) == k and sum(sizes) == len(weights) and min(sizes) >= 1
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    assert heaviest == _brute_force_best(weights, k)


def _mlp():
    return nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def test_balance_by_params_splits_the_weight_evenly():
    model = _mlp()
    assert parameter_counts(list(model)) == [320, 0, 4160, 0, 260]
    # The big middle layer gets a stage of its own.
    assert stage_sizes(list(model), 3, "params") == [2, 1, 2]


def test_shared_parameters_count_once():
    shared = nn.Linear(8, 8)
    assert parameter_counts([shared, nn.Sequential(shared), nn.Linear(8, 1)]) == [72, 0, 9]


class _Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x * 1.0


def test_balance_by_time_follows_measured_time_not_parameters():
    # 0.1 s of sleep dwarfs a tiny Linear even on a busy machine (best of 3 runs each).
    layers = [_Sleep(0.1), nn.Linear(4, 4), _Sleep(0.0), nn.Linear(4, 4), nn.Linear(4, 4)]
    times = measure_layer_times(layers, torch.randn(2, 4), repeats=3)
    assert times[0] >= 0.1 and max(times[1:]) < 0.1
    assert stage_sizes(layers, 2, "time", torch.randn(2, 4)) == [1, 4]
    assert stage_sizes(layers, 2, "params") != [1, 4]
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_split_keeps_layer_objects_and_names():
    model = _mlp()
    stages = split_layers(model, 2, [3, 2])
    assert [len(s) for s in stages] == [3, 2]
    assert stages[1][0] is model[3]
    assert list(stages[1].state_dict()) == ["4.weight", "4.bias"]
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))


def test_explicit_stages_are_used_as_given():
    a, b = nn.Linear(2, 3), nn.Linear(3, 1)
    assert split_layers([a, b], 2) == [a, b]
    assert split_layers(nn.ModuleList([a, b]), 2, balance=None) == [a, b]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="cannot split 5 layers into 6 stages"):
        split_layers(_mlp(), 6)
    with pytest.raises(ValueError, match="cannot split 5 layers into 6 stages"):
        split_layers(_mlp(), 6, "time", torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"balance \[2, 2\] must give every stage .* 5 layers"):
        split_layers(_mlp(), 2, [2, 2])
    with pytest.raises(ValueError, match=r"balance \[5\] gives 1 stages, but there are 2"):
        split_layers(_mlp(), 2, [5])
    with pytest.raises(ValueError, match="unknown balance 'flops'"):
        split_layers(_mlp(), 2, "flops")
    with pytest.raises(ValueError, match="balance='time' needs sample_input"):
        split_layers(_mlp(), 2, "time")
    with pytest.raises(ValueError, match="got 1 explicit stages, but the pipeline has 2"):
        split_layers([nn.Linear(2, 2)], 2)
    with pytest.raises(ValueError, match="needs an nn.Sequential or a list of stage modules"):
        split_layers(nn.Linear(2, 2), 2)
    with pytest.raises(RuntimeError, match=r"layer 1 \(Linear\) failed on inputs of shapes"):
        measure_layer_times([nn.Linear(4, 8), nn.Linear(5, 2)], torch.randn(2, 4))
