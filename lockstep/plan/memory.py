"""Model-state memory per GPU: parameters, gradients and optimizer state, per ZeRO stage.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), section 3.1 and Figure 1: with mixed-precision Adam (fp16/bf16 parameters and
gradients, 2 bytes each; fp32 master weights, momentum and variance, K = 12 bytes) and psi
parameters on N GPUs, model states take

* DDP: ``(2 + 2 + K) psi = 16 psi``
* ZeRO-1 (optimizer states sharded): ``4 psi + K psi / N``
* ZeRO-2 (+ gradients): ``2 psi + (2 + K) psi / N``
* ZeRO-3 (+ parameters): ``(2 + 2 + K) psi / N``

In fp32 the parameters and gradients take 4 bytes each and Adam keeps 8 (momentum, variance); SGD
with momentum keeps 4 and plain SGD none. Activations, buffers and the allocator's slack are not
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZER_STATE_BYTES", "Memory", "model_state_memory"]

# Bytes of optimizer state per parameter, in (mixed precision, fp32) training.
OPTIMIZER_STATE_BYTES = {"adam": (12, 8), "sgd-momentum": (8, 4), "sgd": (4, 0)}


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU of each model state."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_state_memory(parameters: float, world: int, zero_stage: int, *, mixed_precision: bool,
                       optimizer: str = "adam") -> Memory:
    """Bytes per GPU for ``parameters`` on ``world`` GPUs at ``zero_stage`` (0 is plain DDP).

    Mixed precision keeps 2-byte parameters and gradients and ``K`` bytes of fp32 optimizer state
    (master weights included); fp32 training keeps 4-byte parameters and gradients.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    width = 2 if mixed_precision else 4
    k = OPTIMIZER_STATE_BYTES[optimizer][0 if mixed_precision else 1]
    params = width * parameters / (world if zero_stage >= 3 else 1)
    grads = width * parameters / (world if zero_stage >= 2 else 1)
    state = k * parameters / (world if zero_stage >= 1 else 1)
    return Memory(params, grads, state)
