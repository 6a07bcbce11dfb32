"""One stage per rank: a rank plays its own stage's action list, talking to its neighbours.

The ranks of one pipeline form a process group; group rank ``s`` holds stage ``s``. Each rank
walks its list from the schedule: a forward receives its input from stage ``s - 1`` (or takes
it from the batch), a backward receives its output gradient from stage ``s + 1`` (or starts
from the loss). Neither side needs a central coordinator: the schedule is the agreement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.distributed import global_rank
from lockstep.pipeline import comms
from lockstep.pipeline.schedule import Action
from lockstep.pipeline.stage import StageRunner

__all__ = ["StagePeers", "run_rank"]


class StagePeers:
    """The global ranks of a stage's neighbours in its pipeline group."""

    def __init__(self, group: dist.ProcessGroup | None, index: int, num_stages: int) -> None:
        self.group = group
        self.prev = global_rank(group, index - 1) if index > 0 else None
        self.next = global_rank(group, index + 1) if index < num_stages - 1 else None


def _last_backward(actions: Sequence[Action]) -> int | None:
    positions = [i for i, a in enumerate(actions) if a.phase == "B"]
    return positions[-1] if positions else None


@contextlib.contextmanager
def _no_sync(module: torch.nn.Module) -> Iterator[None]:
    """Suspend a data-parallel wrapper's gradient sync (no-op for a plain module)."""
    no_sync = getattr(module, "no_sync", None)
    if no_sync is None:
        yield
    else:
        with no_sync():
            yield


def _arm_sync(module: torch.nn.Module) -> None:
    """Make the next backward of a data-parallel wrapper synchronise its gradients.

    DDP decides at forward time whether the coming backward syncs, but in a pipeline the last
    backward is not the one after the last forward (1F1B runs backwards of older micro-batches
    in between). So every forward runs under ``no_sync`` and the wrapper is told right before
    the last backward, as torch.distributed.pipelining does for torch's DDP.
    """
    if not hasattr(module, "no_sync"):
        return
    sync_next_backward = getattr(module, "sync_next_backward", None)
    if sync_next_backward is None:
        raise RuntimeError(
            f"the pipeline stage is wrapped in {type(module).__name__}, which has no_sync() but "
            "no sync_next_backward(), so lockstep cannot sync only the last micro-batch; wrap "
            "the stage in lockstep.DistributedDataParallel instead"
        )
    sync_next_backward()


def run_rank(
    runner: StageRunner,
    actions: Sequence[Action],
    peers: StagePeers,
    microbatches: Sequence[tuple[torch.Tensor, ...]] | None,
    targets: Sequence[Any] | None,
    loss_scales: Sequence[float],
) -> tuple[dict[int, tuple[torch.Tensor, ...]], dict[int, torch.Tensor]]:
    """Play this rank's ``actions`` for its stage.

    A stage wrapped in :class:`lockstep.DistributedDataParallel` syncs gradients across its
    replicas only in its last backward: earlier micro-batches accumulate locally, as in
    gradient accumulation, so the replicas exchange gradients once per step.

    Args:
        runner: this rank's stage.
        actions: this stage's list from the schedule.
        peers: the neighbouring stages' ranks.
        microbatches: the inputs per micro-batch (first stage only).
        targets: the targets per micro-batch (last stage only), or ``None``.
        loss_scales: each micro-batch's share of the batch (last stage only).

    Returns:
        On the last stage the outputs and losses per micro-batch; empty dicts elsewhere.
    """
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    losses: dict[int, torch.Tensor] = {}
    pending: list = []
    last_backward = _last_backward(actions)
    grads_ahead: tuple[torch.Tensor, ...] | None = None
    for position, action in enumerate(actions):
        mb = action.microbatch
        if action.phase == "F":
            following = actions[position + 1] if position + 1 < len(actions) else None
            # A forward right before a backward sends its output and receives that
            # backward's gradient in one batch (see comms.send_tensors_recv_grads).
            fuse = following.microbatch if following and following.phase == "B" else None
            with _no_sync(runner.module):
                grads_ahead = _forward(runner, mb, peers, microbatches, targets, loss_scales,
                                       pending, outputs, losses, fuse)
        elif position == last_backward:
            _arm_sync(runner.module)
            _backward(runner, mb, peers, pending, grads_ahead)
        else:
            with _no_sync(runner.module):
                _backward(runner, mb, peers, pending, grads_ahead)
        if action.phase == "B":
            grads_ahead = None
    # Only on success: after a failure the neighbour may never take these messages, and
    # waiting would turn the error into a hang.
    comms.wait_all(pending)
    return outputs, losses


def _forward(
    runner: StageRunner,
    mb: int,
    peers: StagePeers,
    microbatches: Sequence[tuple[torch.Tensor, ...]] | None,
    targets: Sequence[Any] | None,
    loss_scales: Sequence[float],
    pending: list,
    outputs: dict[int, tuple[torch.Tensor, ...]],
    losses: dict[int, torch.Tensor],
    fuse_with: int | None,
) -> tuple[torch.Tensor, ...] | None:
    """Run one forward; with ``fuse_with``, also receive that micro-batch's output gradients."""
    if peers.prev is None:
        assert microbatches is not None  # checked by the Pipeline before the step
        inputs = microbatches[mb]
    else:
        inputs = comms.recv_tensors(peers.prev, peers.group, runner.device)
    target = targets[mb] if targets is not None else None
    out, loss = runner.forward(mb, inputs, target, loss_scales[mb] if loss_scales else 1.0)
    if peers.next is None:
        outputs[mb] = out
        if loss is not None:
            losses[mb] = loss
        return None
    if fuse_with is None:
        pending += comms.send_tensors(out, peers.next, peers.group, runner.device)
        return None
    sends, grads = comms.send_tensors_recv_grads(
        out, runner.grad_slots(fuse_with), peers.next, peers.group, runner.device
    )
    pending += sends
    return grads


def _backward(
    runner: StageRunner,
    mb: int,
    peers: StagePeers,
    pending: list,
    grads: tuple[torch.Tensor, ...] | None,
) -> None:
    if grads is None and peers.next is not None:
        grads = comms.recv_grads(runner.grad_slots(mb), peers.next, peers.group, runner.device)
    grad_inputs = runner.backward(mb, grads)
    if peers.prev is not None:
        pending += comms.send_grads(grad_inputs, peers.prev, peers.group)
