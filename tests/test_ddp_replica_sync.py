"""Parameter signatures across ranks: pure comparison logic (the multi-rank error is in test_ddp)."""

from __future__ import annotations

from torch import nn

from lockstep.ddp.replica_sync import first_mismatch, parameter_signature


def sig(model: nn.Module):
    return parameter_signature(model.named_parameters())


def test_equal_models_match():
    assert first_mismatch(sig(nn.Linear(3, 4)), sig(nn.Linear(3, 4))) is None


def test_shape_dtype_name_and_count_differences_are_described():
    base = sig(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    assert "has shape [5, 4], rank 0 has [2, 4]" in first_mismatch(
        base, sig(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))))
    assert "dtype float64, rank 0 has float32" in first_mismatch(
        base, sig(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()))
    renamed = [("x" + entry[0], *entry[1:]) for entry in base]
    assert "parameter 'x0.weight' where rank 0 has '0.weight'" in first_mismatch(base, renamed)
    fewer = first_mismatch(base, base[:2])
    assert "2 parameters, rank 0 has 4" in fewer and "'1.weight'" in fewer


def test_requires_grad_differences_are_described():
    frozen = nn.Linear(3, 4)
    frozen.weight.requires_grad_(False)
    assert "'weight' has requires_grad=False, rank 0 has requires_grad=True" in first_mismatch(
        sig(nn.Linear(3, 4)), sig(frozen))
