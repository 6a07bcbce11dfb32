"""The ways to spread a step over GPUs that the planner prices, and their names on the CLI.

==============  ==========================================================================
``ddp``         DistributedDataParallel: one all-reduce per gradient bucket, overlapped
``ddp-bf16``    DDP with gradients cast to bf16 for the all-reduce (``ddp-fp16`` alike)
``compress:R``  DDP sending ``R`` times the gradient bytes (e.g. ``compress:0.1``)
``zero1``       DDP + optimizer state sharded: step on 1/N, all-gather parameters after
``zero2``       + gradients reduce-scattered instead of all-reduced
``zero3``       + parameters sharded: all-gathered again in forward and in backward
``localsgd:H``  each GPU steps alone, parameters averaged every H steps
``diloco:H``    local SGD with an outer optimizer on the averaged change every H steps
``dp``          single-process DataParallel (one node only): replicate, reduce to device 0
==============  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_STRATEGIES", "Strategy", "parse_strategies", "parse_strategy"]

DEFAULT_STRATEGIES = ("ddp", "ddp-bf16", "zero1", "zero2", "zero3", "localsgd:8", "dp")


@dataclass(frozen=True)
class Strategy:
    """How gradients, parameters and optimizer state move (see the module table)."""

    name: str
    zero_stage: int = 0
    ratio: float = 1.0  # bytes sent / gradient bytes
    sync_every: int = 1  # local SGD: steps between parameter averages
    outer_optimizer: bool = False  # DiLoCo
    averages_parameters: bool = False  # local SGD / DiLoCo: no gradient all-reduce
    data_parallel: bool = False  # single-process DataParallel

    @property
    def exact(self) -> bool:
        """Whether it computes the same update as one GPU on the whole batch (up to rounding).

        Local SGD and DiLoCo change the algorithm, so they are never marked best by default.
        """
        return not self.averages_parameters

    @property
    def broadcasts_buffers(self) -> bool:
        """Whether the model runs under DDP, which broadcasts rank 0's buffers before every forward.

        DDP and its compressed variants, ZeRO-1 (an optimizer beside DDP) and local SGD/DiLoCo
        (DDP with a hook that sends nothing) do; lockstep's ZeRO-2 runs unwrapped or under
        ``no_sync`` and FSDP (ZeRO-3) keeps each rank's buffers, so they do not; DataParallel
        copies buffers with the parameters when it replicates (priced there).
        """
        return not self.data_parallel and self.zero_stage <= 1


def parse_strategy(text: str, grad_dtype: str = "float32") -> Strategy:
    """One strategy name from the module table."""
    key = text.strip().lower()
    name, _, arg = key.partition(":")
    if name in ("ddp", "zero1", "zero2", "zero3", "dp") and not arg:
        stage = int(name[-1]) if name.startswith("zero") else 0
        return Strategy(key, zero_stage=stage, data_parallel=name == "dp")
    if name in ("ddp-bf16", "ddp-fp16") and not arg:
        width = 4 if grad_dtype in ("float32", "fp32") else 2 if grad_dtype != "float64" else 8
        return Strategy(key, ratio=min(1.0, 2 / width))
    if name == "compress":
        ratio = _number(arg, text, float)
        if not 0 < ratio <= 1:
            raise ValueError(f"strategy {text!r}: the ratio must be in (0, 1], e.g. compress:0.25")
        return Strategy(key, ratio=ratio)
    if name in ("localsgd", "diloco"):
        every = int(_number(arg or "8", text, int))
        if every < 1:
            raise ValueError(f"strategy {text!r}: H must be >= 1, e.g. {name}:8")
        return Strategy(key, sync_every=every, outer_optimizer=name == "diloco",
                        averages_parameters=True)
    raise ValueError(f"unknown strategy {text!r}: use ddp, ddp-bf16, ddp-fp16, compress:R, zero1, "
                     "zero2, zero3, localsgd:H, diloco:H or dp")


def _number(arg: str, text: str, kind: type) -> float:
    try:
        return kind(arg)
    except ValueError:
        raise ValueError(f"strategy {text!r}: {arg!r} is not a number") from None


def parse_strategies(spec: str | list[str], grad_dtype: str = "float32") -> list[Strategy]:
    """A comma-separated list (or a list) of strategy names, duplicates dropped."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Strategy] = []
    for item in items:
        if item.strip():
            s = parse_strategy(item, grad_dtype)
            if s.name not in {o.name for o in out}:
                out.append(s)
    if not out:
        raise ValueError("no strategy given")
    return out
