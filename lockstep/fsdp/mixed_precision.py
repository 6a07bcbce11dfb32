"""The mixed-precision policy of a fully sharded unit (torch's ``MixedPrecisionPolicy`` names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lockstep.tensors import map_tensors

__all__ = ["MixedPrecisionPolicy", "as_policy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a unit computes and reduces; the sharded parameters keep their own dtype (fp32).

    Args:
        param_dtype: dtype the parameters are all-gathered in and the forward/backward compute
            in (``None``: the parameters' own dtype). bf16 halves the all-gather bytes.
        reduce_dtype: dtype the gradients are reduce-scattered in (``None``: ``param_dtype``).
            The reduced gradient is then accumulated into the fp32 shard's ``.grad``; reducing
            in fp32 while computing in bf16 is what keeps large jobs stable.
        output_dtype: torch's field, accepted by name and position; anything but ``None`` is a
            ``NotImplementedError`` (the root's outputs keep the compute dtype).
        cast_forward_inputs: cast floating-point tensors passed to the unit's forward to
            ``param_dtype``.

    Example::

        policy = lockstep.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            lockstep.fully_shard(block, mp_policy=policy)
        lockstep.fully_shard(model, mp_policy=policy)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None  # torch's field, in torch's order; not supported
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if self.output_dtype is not None:  # a TypeError (unknown argument) until 2026-11-29
            raise _no_output_dtype(self.output_dtype)
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype, got {value!r}")

    def compute_dtype(self, own: torch.dtype) -> torch.dtype:
        """The dtype parameters are gathered and used in, for parameters stored in ``own``."""
        return self.param_dtype or own

    def gradient_dtype(self, own: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in, for parameters stored in ``own``."""
        return self.reduce_dtype or self.param_dtype or own

    def cast_inputs(self, obj: Any) -> Any:
        """``obj`` with its floating tensors in ``param_dtype`` (unchanged without one)."""
        if self.param_dtype is None or not self.cast_forward_inputs:
            return obj
        dtype = self.param_dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() else t

        return map_tensors(obj, cast)


def as_policy(policy: Any) -> MixedPrecisionPolicy:
    """``policy`` as lockstep's: ``None`` is the default; torch's ``MixedPrecisionPolicy``
    (same field names) is converted.

    Raises:
        NotImplementedError: torch's ``output_dtype`` was set (outputs keep the compute dtype).
        TypeError: something else than a policy.
    """
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "cast_forward_inputs")
    if not all(hasattr(policy, name) for name in fields):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")
    if getattr(policy, "output_dtype", None) is not None:
        raise _no_output_dtype(policy.output_dtype)
    return MixedPrecisionPolicy(**{name: getattr(policy, name) for name in fields})


def _no_output_dtype(dtype: Any) -> NotImplementedError:
    return NotImplementedError(
        f"fully_shard: MixedPrecisionPolicy(output_dtype={dtype}) is not supported: the root's "
        "outputs keep the compute dtype; cast them after the forward")
