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
from lockstep.pipeline.stage import StageRunner, StageStats

__all__ = ["StagePeers", "run_rank"]


class StagePeers:
    """The global ranks of a stage's neighbours in its pipeline group, and their action lists.

    With the neighbours' lists (the schedule is the agreement) a stage knows when a neighbour
    has taken what it was sent, and frees it then (see :class:`_Outbox`); without them sends
    are kept until the end of the step.
    """

    def __init__(self, group: dist.ProcessGroup | None, index: int, num_stages: int,
                 schedule: Sequence[Sequence[Action]] | None = None) -> None:
        self.group = group
        self.prev = global_rank(group, index - 1) if index > 0 else None
        self.next = global_rank(group, index + 1) if index < num_stages - 1 else None
        lists = schedule or []
        self.prev_order = _positions(lists[index - 1]) if lists and self.prev is not None else {}
        self.next_order = _positions(lists[index + 1]) if lists and self.next is not None else {}


def _positions(actions: Sequence[Action]) -> dict[tuple[str, int], int]:
    return {(a.phase, a.microbatch): i for i, a in enumerate(actions)}


class _Outbox:
    """Sends in flight, each finished and freed as soon as its peer has certainly taken it.

    A neighbour that sends us something from its action at position ``P`` has finished every
    action before ``P``, its blocking receives included: our sends that it takes before ``P``
    are complete, and waiting for them costs nothing. (Waiting earlier could block on a
    neighbour busy sending to us; keeping every send to the end of the step held all the
    step's activations or gradients, ``m`` micro-batches, where 1F1B needs a few.)
    """

    def __init__(self, stats: StageStats) -> None:
        self._items: list[tuple[Any, Any, int, int, int]] = []  # work, payload, peer, at, bytes
        self._stats = stats
        self._bytes = 0
        stats.peak_sent_bytes = 0

    def add(self, sends: list, taken_at: int | None) -> None:
        position = taken_at if taken_at is not None else 1 << 62  # unknown: the step's end
        seen: set[int] = set()
        for work, payload, peer in sends:
            held = [t for t in (payload if isinstance(payload, list) else [payload])
                    if id(t) not in seen]
            seen.update(id(t) for t in held)
            nbytes = sum(t.numel() * t.element_size() for t in held)
            self._items.append((work, payload, peer, position, nbytes))
            self._bytes += nbytes
        self._stats.peak_sent_bytes = max(self._stats.peak_sent_bytes, self._bytes)

    def peer_passed(self, peer: int | None, position: int | None) -> None:
        """``peer`` sent us what it sends at ``position`` of its list: free what it took before."""
        if peer is None or position is None:
            return
        done = [item for item in self._items if item[2] == peer and item[3] < position]
        if done:
            self._items = [item for item in self._items if not (item[2] == peer and item[3] < position)]
            self._finish(done)

    def finish(self) -> None:
        items, self._items = self._items, []
        self._finish(items)

    def _finish(self, items: list) -> None:
        comms.wait_all([(work, payload, peer) for work, payload, peer, _, _ in items])
        self._bytes -= sum(item[4] for item in items)


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
    gradient accumulation, so the replicas exchange gradients once per step; none at all in a
    step run inside the wrapper's ``no_sync()``.

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
    pending = _Outbox(runner.stats)
    # A step run inside the user's own no_sync() (accumulating over steps) syncs in none of its
    # backwards; otherwise in its last one only.
    last_backward = (_last_backward(actions)
                     if getattr(runner.module, "require_backward_grad_sync", True) else None)
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
    pending.finish()
    _arm_buffer_sync(runner.module, synced=last_backward is not None)
    return outputs, losses


def _arm_buffer_sync(module: torch.nn.Module, synced: bool) -> None:
    """Let the next step's first forward broadcast a data-parallel wrapper's buffers.

    DDP broadcasts buffers (BatchNorm statistics) in a forward that follows a synchronised
    one. Every forward of a pipeline step runs under ``no_sync``, so without this the replicas'
    buffers were synced in the very first forward only and drifted apart afterwards (until
    2026-11-29). As with DDP, a step run inside the user's ``no_sync()`` does not arm it.
    """
    if hasattr(module, "no_sync") and hasattr(module, "require_forward_param_sync"):
        setattr(module, "require_forward_param_sync", synced)  # noqa: B010 - DDP's flag


def _forward(
    runner: StageRunner,
    mb: int,
    peers: StagePeers,
    microbatches: Sequence[tuple[torch.Tensor, ...]] | None,
    targets: Sequence[Any] | None,
    loss_scales: Sequence[float],
    pending: _Outbox,
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
        pending.peer_passed(peers.prev, peers.prev_order.get(("F", mb)))
    target = targets[mb] if targets is not None else None
    out, loss = runner.forward(mb, inputs, target, loss_scales[mb] if loss_scales else 1.0)
    if peers.next is None:
        outputs[mb] = out
        if loss is not None:
            losses[mb] = loss
        return None
    taken_at = peers.next_order.get(("F", mb))
    if fuse_with is None:
        pending.add(comms.send_tensors(out, peers.next, peers.group, runner.device), taken_at)
        return None
    sends, grads = comms.send_tensors_recv_grads(
        out, runner.grad_slots(fuse_with), peers.next, peers.group, runner.device
    )
    pending.add(sends, taken_at)
    pending.peer_passed(peers.next, peers.next_order.get(("B", fuse_with)))
    return grads


def _backward(
    runner: StageRunner,
    mb: int,
    peers: StagePeers,
    pending: _Outbox,
    grads: tuple[torch.Tensor, ...] | None,
) -> None:
    if grads is None and peers.next is not None:
        grads = comms.recv_grads(runner.grad_slots(mb), peers.next, peers.group, runner.device)
        pending.peer_passed(peers.next, peers.next_order.get(("B", mb)))
    grad_inputs = runner.backward(mb, grads)
    if peers.prev is not None:
        pending.add(comms.send_grads(grad_inputs, peers.prev, peers.group),
                    peers.prev_order.get(("B", mb)))
