"""Every stage in this process, each on its own device: the schedule played in one thread.

Actions run in the order a simulation of the schedule starts them, so each stage does its own
list in order and holds exactly the activations the schedule says it does. Tensors move between
stages' devices with ``Tensor.to``; on CUDA those copies and kernels are asynchronous, so
stages on different GPUs still overlap while this thread queues work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lockstep.pipeline.schedule import Schedule, simulate
from lockstep.pipeline.stage import StageRunner

__all__ = ["run_local"]


def _move(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def run_local(
    runners: Sequence[StageRunner],
    schedule: Schedule,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    targets: Sequence[Any] | None,
    loss_scales: Sequence[float],
) -> tuple[list[tuple[torch.Tensor, ...]], list[torch.Tensor]]:
    """Run ``schedule`` over all ``runners`` (one per stage) in this process.

    Args:
        runners: the stages, in pipeline order.
        schedule: one action list per stage (see :mod:`lockstep.pipeline.schedule`).
        microbatches: the inputs of each micro-batch.
        targets: each micro-batch's target, or ``None``.
        loss_scales: each micro-batch's share of the batch.

    Returns:
        The last stage's outputs per micro-batch, and the losses (unscaled) when there are any.
    """
    last = len(runners) - 1
    forward_mail: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    backward_mail: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    losses: dict[int, torch.Tensor] = {}
    for stage, position in simulate(schedule).order():
        action = schedule[stage][position]
        runner, mb = runners[stage], action.microbatch
        if action.phase == "F":
            if stage == 0:
                inputs = _move(microbatches[mb], runner.device)
            else:
                inputs = _move(forward_mail.pop((stage, mb)), runner.device)
            target = targets[mb] if targets is not None and stage == last else None
            out, loss = runner.forward(mb, inputs, target, loss_scales[mb])
            if stage < last:
                forward_mail[(stage + 1, mb)] = out
            else:
                outputs[mb] = out
                if loss is not None:
                    losses[mb] = loss
        else:
            grads = None
            if stage < last:
                grads = _move(backward_mail.pop((stage, mb)), runner.device)
            grad_inputs = runner.backward(mb, grads)
            if stage > 0:
                backward_mail[(stage - 1, mb)] = grad_inputs
    ordered = sorted(outputs)
    return [outputs[i] for i in ordered], [losses[i] for i in sorted(losses)]
