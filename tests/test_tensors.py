"""lockstep.tensors: the one walk over nested batches."""

import dataclasses
from collections import OrderedDict, namedtuple

import torch

from lockstep.tensors import iter_tensors, map_tensors, move_to

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    label: str


def test_map_keeps_container_types_and_non_tensors():
    nest = {"a": (torch.ones(1), [torch.zeros(2)]), "p": Pair(torch.ones(1), 3),
            "b": Batch(torch.ones(2), "hi"), "o": OrderedDict(k=torch.ones(1))}
    out = map_tensors(nest, lambda t: t + 1)
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert isinstance(out["p"], Pair) and out["p"].y == 3
    assert isinstance(out["b"], Batch) and out["b"].label == "hi"
    assert isinstance(out["o"], OrderedDict)
    assert torch.equal(out["a"][1][0], torch.ones(2))
    assert torch.equal(out["b"].ids, torch.full((2,), 2.0))
    assert len(list(iter_tensors(nest))) == 5


def test_move_to_device():
    out = move_to([torch.ones(1, dtype=torch.float64)], "cpu")
    assert out[0].device.type == "cpu"


def test_batch_size_one_walk_for_every_batch():
    from lockstep.tensors import batch_size

    @dataclasses.dataclass
    class Batch:
        weight: torch.Tensor
        tokens: torch.Tensor

    # A 0-dim tensor in front (a loss weight, a flag) is not the batch: the next tensor is.
    assert batch_size((torch.tensor(1.0), torch.zeros(8, 3))) == 8
    assert batch_size(Batch(torch.tensor(0.5), torch.zeros(4, 2))) == 4
    assert batch_size({"x": [torch.zeros(5, 6)]}, dim=1) == 6
    assert batch_size({"n": 3, "flag": torch.tensor(True)}) is None


@dataclasses.dataclass
class Masked:
    x: torch.Tensor
    mask: torch.Tensor | None = dataclasses.field(init=False, default=None)
    n_valid: int = dataclasses.field(init=False, default=0)


def test_fields_outside_init_keep_their_values_and_tensors_are_mapped():
    batch = Masked(torch.ones(4))
    batch.mask, batch.n_valid = torch.tensor([1, 1, 1, 0]), 3  # set after __init__
    out = map_tensors(batch, lambda t: t * 2)
    assert out.n_valid == 3 and torch.equal(out.mask, torch.tensor([2, 2, 2, 0]))
    assert torch.equal(out.x, torch.full((4,), 2.0)) and batch.n_valid == 3  # a copy


def test_a_packed_sequence_keeps_its_batch_sizes_on_the_cpu():
    from torch.nn.utils.rnn import pack_padded_sequence

    packed = pack_padded_sequence(torch.ones(3, 2, 1), torch.tensor([3, 2]), enforce_sorted=False)
    out = move_to(packed, "meta")
    assert out.data.device.type == "meta" and out.batch_sizes.device.type == "cpu"
    assert out.sorted_indices.device.type == "meta"
