"""Scatter and gather: splitting, nesting, scalars, autograd, and the error messages."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from lockstep.dp.scatter_gather import count_replicas, gather, move_to_device, scatter, scatter_kwargs

CPU3 = ["cpu", "cpu", "cpu"]


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    name: str = "b"


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_uneven_split_differs_by_at_most_one_and_covers_the_batch():
    x = torch.arange(14).view(7, 2)
    pieces = scatter((x,), CPU3)
    assert [p[0].shape[0] for p in pieces] == [3, 2, 2]
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)


def test_small_batch_feeds_fewer_replicas():
    pieces = scatter((torch.ones(2, 3), "tag"), CPU3)
    assert len(pieces) == 2
    assert [p[1] for p in pieces] == ["tag", "tag"]
    assert count_replicas(torch.ones(2, 3), 3) == 2


def test_nested_structures_split_together_and_keep_their_types():
    x = torch.randn(5, 3)
    inputs = ({"img": x, "meta": [x * 2, 7]}, Batch(x + 1, "n"), Pair(x, x - 1), torch.tensor(0.5))
    pieces = scatter(inputs, ["cpu", "cpu"])
    assert len(pieces) == 2
    first = pieces[0]
    assert torch.equal(first[0]["img"], x[:3]) and torch.equal(first[0]["meta"][0], x[:3] * 2)
    assert first[0]["meta"][1] == 7
    assert isinstance(first[1], Batch) and first[1].name == "n" and torch.equal(first[1].x, x[:3] + 1)
    assert isinstance(first[2], Pair) and torch.equal(pieces[1][2].b, x[3:] - 1)
    assert all(p[3].item() == 0.5 for p in pieces)  # a scalar goes whole to every replica


def test_scatter_kwargs_and_dim():
    x = torch.arange(12).view(2, 6)
    args, kwargs = scatter_kwargs((x,), {"mask": x > 3, "flag": True}, ["cpu", "cpu"], dim=1)
    assert len(args) == len(kwargs) == 2
    assert torch.equal(args[1][0], x[:, 3:]) and torch.equal(kwargs[1]["mask"], x[:, 3:] > 3)
    assert kwargs[0]["flag"] is True


def test_scatter_then_gather_round_trips_with_gradients():
    x = torch.randn(5, 2, requires_grad=True)
    pieces = scatter(x, CPU3)
    out = gather([p * (i + 1) for i, p in enumerate(pieces)], "cpu")
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 1, 2, 2, 3]).unsqueeze(1).expand(5, 2))


def test_gather_nested_outputs_and_plain_values():
    outs = [
        {"y": torch.zeros(2, 1), "aux": (torch.ones(2), None), "k": 3, "b": Batch(torch.ones(2), "z")},
        {"y": torch.ones(1, 1), "aux": (torch.zeros(1), None), "k": 4, "b": Batch(torch.zeros(1), "z")},
    ]
    g = gather(outs, -1)
    assert torch.equal(g["y"], torch.tensor([[0.0], [0.0], [1.0]]))
    assert torch.equal(g["aux"][0], torch.tensor([1.0, 1.0, 0.0])) and g["aux"][1] is None
    assert g["k"] == [3, 4]  # differing plain values: one per replica
    assert isinstance(g["b"], Batch) and g["b"].name == "z" and g["b"].x.shape == (3,)


def test_gather_scalars_become_a_vector_with_a_warning():
    with pytest.warns(UserWarning, match="one value per replica"):
        out = gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert torch.equal(out, torch.tensor([1.0, 2.0]))


def test_move_to_device_keeps_structure():
    moved = move_to_device({"a": [torch.ones(1)], "b": 2}, "cpu")
    assert moved["b"] == 2 and torch.equal(moved["a"][0], torch.ones(1))


def test_scatter_errors_name_the_input():
    with pytest.raises(ValueError, match=r"cannot scatter inputs\[0\]\['x'\] \(shape \(3,\)\) along dim=1"):
        scatter(({"x": torch.ones(3)},), CPU3, dim=1)
    with pytest.raises(ValueError, match=r"cannot scatter inputs\[1\]: it is empty along dim=0"):
        scatter((torch.ones(2), torch.ones(0)), CPU3)


def test_gather_errors_name_the_mismatch():
    with pytest.raises(ValueError, match=r"different keys at output: \['a'\] vs \['b'\]"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], "cpu")
    with pytest.raises(ValueError, match=r"replica 0 returned tuple at output\[0\] but replica 1 returned list"):
        gather([((torch.ones(1),),), ([torch.ones(1)],)], "cpu")
    with pytest.raises(ValueError, match=r"tensor and a non-tensor at output\['y'\]"):
        gather([{"y": torch.ones(1)}, {"y": 3}], "cpu")
    with pytest.raises(ValueError, match=r"different lengths at output: 2 vs 1"):
        gather([(torch.ones(1), torch.ones(1)), (torch.ones(1),)], "cpu")


@pytest.mark.gpu
def test_scatter_gather_on_gpus():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    x = torch.randn(9, 4, requires_grad=True)
    pieces = scatter((x,), devices)
    assert [p[0].device for p in pieces] == devices[: len(pieces)]
    out = gather([p[0] * 2 for p in pieces], devices[0])
    out.sum().backward()
    assert out.device == devices[0] and torch.allclose(out.cpu(), x.detach() * 2)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# --- found by an outside audit (diag/dp7), 2026-11-29 -------------------------------------------


def test_gather_looks_dict_keys_up_by_name():
    # torch's gather takes replica 0's key order and looks the others up by name.
    out = gather([{"a": torch.zeros(1), "b": torch.ones(1)}, {"b": torch.ones(2), "a": torch.zeros(2)}], "cpu")
    assert list(out) == ["a", "b"]
    assert torch.equal(out["a"], torch.zeros(3)) and torch.equal(out["b"], torch.ones(3))


def test_gather_keeps_dataclass_fields_outside_init():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        aux: torch.Tensor | None = dataclasses.field(init=False, default=None)

    parts = []
    for i in range(2):
        part = Out(torch.full((2,), float(i)))
        part.aux = torch.full((2,), float(i + 10))
        parts.append(part)
    out = gather(parts, "cpu")
    assert torch.equal(out.aux, torch.tensor([10.0, 10.0, 11.0, 11.0]))


def test_chunks_after_the_first_have_their_own_version_counter_while_grad_is_on():
    x = torch.randn(6, 2)
    pieces = scatter((x,), CPU3)
    first, second, third = (p[0] for p in pieces)
    second.add_(1)  # a forward writing its input in place
    assert first._version == 0 and third._version == 0
    assert first._base is x  # the first chunk stays a view, as on torch's device 0
    with torch.no_grad():  # nothing to invalidate: no copies
        assert all(p[0]._base is x for p in scatter((x,), CPU3))
