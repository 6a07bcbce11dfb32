"""Local SGD and DiLoCo: each rank steps alone for H steps, then the replicas are merged.

For links far slower than compute, even compressed gradients every step cost too much. Local SGD
(Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019) lets every rank run its
own optimizer for ``sync_every`` steps and then averages the parameters: one all-reduce of the
model per H steps instead of one per step. DiLoCo (Douillard et al., "DiLoCo: Distributed
Low-Communication Training of Language Models", 2023) treats the averaged change since the last
merge as a pseudo-gradient for an *outer* optimizer, Nesterov SGD in the paper, which lets H
grow to hundreds of steps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm.hooks import GradBucket, completed_future
from lockstep.comm.state import ByteCounter
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.distributed import global_rank, resolve_group
from lockstep.shards import is_shard

__all__ = ["LocalSGD", "local_gradients_hook"]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def local_gradients_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A comm hook that sends nothing: each rank keeps its own gradients."""
    return completed_future(bucket.buffer())


def _refuse_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Local SGD merges whole replicas: a model or optimizer that shards its state has none."""
    sharded = [name for name, p in model.named_parameters() if is_shard(p)]
    if sharded:
        raise TypeError(
            f"LocalSGD: the model is sharded by fully_shard (parameter {sharded[0]!r} is one "
            "rank's shard), so the ranks hold no replicas to merge and its gradients are still "
            "reduced every step. Use LocalSGD with a plain or DistributedDataParallel model"
        )
    if callable(getattr(optimizer, "consolidate_state_dict", None)):
        raise TypeError(
            f"LocalSGD: {type(optimizer).__name__} shards the optimizer across ranks and "
            "broadcasts each shard from its owner at every step, which is neither local SGD nor "
            "DDP. Pass the plain optimizer (e.g. torch.optim.AdamW) that each rank steps alone"
        )


def _flat_groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by (device, dtype) so each group is one flat all-reduce."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.device, tensor.dtype)].append(tensor)
    return list(groups.values())


class LocalSGD:
    """Wrap a model and its optimizer so ranks synchronise every ``sync_every`` steps.

    Works with a plain module (the replicas are made equal by a broadcast from rank 0 here) or
    with :class:`lockstep.DistributedDataParallel`, whose per-step gradient all-reduce is
    switched off by registering :func:`local_gradients_hook` (so register no other hook).
    Call :meth:`step` instead of ``optimizer.step()``.

    Args:
        model: the module, or its DistributedDataParallel wrapper.
        optimizer: the inner optimizer over the model's parameters.
        sync_every: H, the local steps between two merges.
        process_group: the group to merge over; ``None`` means the default group.
        outer_optimizer: ``None`` to average the parameters, or a function building the outer
            optimizer over a list of tensors (DiLoCo), e.g.
            ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)``.
        counter: where the bytes sent are added up (a new one by default).

    Raises:
        ValueError: ``sync_every`` below 1.

    Example::

        ddp = lockstep.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        local = lockstep.LocalSGD(ddp, opt, sync_every=16)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            local.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        counter: ByteCounter | None = None,
    ) -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool):
            raise TypeError(f"sync_every must be an int (steps between merges), got {sync_every!r}")
        if sync_every < 1:
            raise ValueError(
                f"sync_every must be at least 1 (steps between merges), got {sync_every}"
            )
        _refuse_sharded(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.process_group = resolve_group(process_group)
        self.counter = counter if counter is not None else ByteCounter()
        self.local_steps = 0
        self._all = list(model.parameters())
        # Which parameters the next merge averages: those trainable now or at any step since
        # the last merge (a layer unfrozen during fine-tuning is merged from then on; the
        # parameters trainable when it was built only were until 2026-11-29, and the ranks'
        # copies of a layer unfrozen later drifted apart for good).
        self._trained = [p.requires_grad for p in self._all]
        # Running statistics (BatchNorm) are merged too; integer counters are equal anyway.
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        register = getattr(model, "register_comm_hook", None)
        if callable(register):
            register(None, local_gradients_hook)
        else:
            self._broadcast_from_first_rank()
        self._anchors: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        self._outer_params: list[torch.Tensor] = []
        if outer_optimizer is not None:
            self._outer_params = self._params
            self._anchors = [p.detach().clone() for p in self._outer_params]
            self.outer = outer_optimizer(self._anchors)

    @property
    def _params(self) -> list[torch.Tensor]:
        """The parameters the next merge takes (see ``_trained``), in the model's order."""
        return [p for p, trained in zip(self._all, self._trained) if trained]

    def _note_trainable(self) -> None:
        """Mark the parameters trainable now as trained since the last merge; DiLoCo refuses
        one its outer optimizer was not built over (called before the step that would train it)."""
        for i, p in enumerate(self._all):
            if p.requires_grad and not self._trained[i]:
                if self.outer is not None:
                    names = [n for n, q in self.model.named_parameters() if q is p]
                    raise ValueError(
                        f"LocalSGD: parameter {names[0] if names else i!r} became trainable after "
                        "LocalSGD was built with an outer optimizer (DiLoCo), whose anchors and "
                        "state cover the parameters trainable then only; build LocalSGD (and "
                        "its outer optimizer) after setting requires_grad"
                    )
                self._trained[i] = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One inner optimizer step; every ``sync_every``-th one also merges the ranks."""
        self._note_trainable()
        loss = self.optimizer.step(closure)
        self.local_steps += 1
        if self.local_steps % self.sync_every == 0:
            self.sync()
        self.counter.end_step()
        return loss

    @torch.no_grad()
    def sync(self) -> None:
        """Merge the replicas now: average them, or take one outer step on the averaged change."""
        self._note_trainable()
        if self.outer is None:
            self._average(self._params)
            # Equal on every rank now: a parameter frozen since is left out of later merges.
            self._trained = [p.requires_grad for p in self._all]
        else:
            self._outer_step(self.outer)
        self._average(self._buffers)

    def _outer_step(self, outer: torch.optim.Optimizer) -> None:
        # The pseudo-gradient is anchor - replica, averaged: the mean change, sign as a gradient.
        deltas = [anchor - p for anchor, p in zip(self._anchors, self._outer_params)]
        self._average(deltas)
        for anchor, delta in zip(self._anchors, deltas):
            anchor.grad = delta
        outer.step()
        outer.zero_grad(set_to_none=True)
        for anchor, p in zip(self._anchors, self._outer_params):
            p.copy_(anchor)

    def _average(self, tensors: Sequence[torch.Tensor]) -> None:
        world = dist.get_world_size(self.process_group)
        for group in _flat_groups(tensors):
            flat = torch.cat([t.reshape(-1) for t in group]).div_(world)
            self.counter.record(flat)
            hang.run(group_progress(self.process_group), "LocalSGD parameter average",
                     partial(dist.all_reduce, flat, group=self.process_group))
            start = 0
            for t in group:
                t.copy_(flat[start : start + t.numel()].view_as(t))
                start += t.numel()

    @torch.no_grad()
    def _broadcast_from_first_rank(self) -> None:
        """Every parameter and buffer from rank 0, frozen ones and integer counters too (only
        the trainable ones and the floating-point buffers are merged later)."""
        source = global_rank(self.process_group, 0)
        progress = group_progress(self.process_group)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            hang.run(progress, "LocalSGD start-up broadcast from rank 0",
                     partial(dist.broadcast, tensor.detach(), src=source, group=self.process_group))

    def state_dict(self) -> dict[str, Any]:
        """The inner (and outer) optimizer state, the anchors and the step count."""
        return {
            "local_steps": self.local_steps,
            "optimizer": self.optimizer.state_dict(),
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "anchors": [a.clone() for a in self._anchors],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._check_outer(state)
        self.local_steps = state["local_steps"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
            with torch.no_grad():
                for anchor, saved in zip(self._anchors, state["anchors"]):
                    anchor.copy_(saved)

    # -- one piece per rank, for lockstep.Checkpointer (see lockstep.checkpoint.sharded) ------

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's piece: :meth:`state_dict` plus this replica's parameters and buffers.

        Between merges every rank holds its own replica and its own inner optimizer state
        (momentum, Adam's moments): :class:`lockstep.Checkpointer` saves one piece per rank, so
        that a run resumed from any step continues as if it had not stopped.
        """
        trained = [i for i, flag in enumerate(self._trained) if flag]
        return {**self.state_dict(), "replica": [self._all[i].detach() for i in trained],
                "replica_index": trained, "buffers": list(self._buffers)}

    @torch.no_grad()
    def load_sharded_state_dict(self, pieces: Sequence[Any]) -> None:
        """Load this rank's piece (``pieces[r]`` was saved by rank ``r``).

        Restored by a world of another size, every rank starts from the mean of the saved
        replicas (what a merge would have given) and rank ``r`` takes the inner optimizer state
        saved by rank ``r % saved world``.
        """
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        own = pieces[rank % len(pieces)]
        saved = [own] if len(pieces) == world else [pieces[r] for r in range(len(pieces))]
        # Pieces written before 2026-11-29 hold the parameters trainable at construction.
        index = own.get("replica_index", [i for i, p in enumerate(self._all) if p.requires_grad])
        for piece in saved:
            if (len(piece["replica"]) != len(index) or any(i >= len(self._all) for i in index)
                    or piece.get("replica_index", index) != index
                    or len(piece["buffers"]) != len(self._buffers)):
                raise ValueError(
                    f"the checkpoint's LocalSGD piece holds {len(piece['replica'])} parameters and "
                    f"{len(piece['buffers'])} buffers, this model has {len(self._all)} parameters "
                    f"({sum(p.requires_grad for p in self._all)} trainable) and "
                    f"{len(self._buffers)} floating-point buffers: restore into the same model"
                )
        params = [self._all[i] for i in index]
        # One replica: this rank's own. Another world: the mean of the saved replicas.
        replica = [torch.stack([p["replica"][i] for p in saved]).mean(0) if len(saved) > 1
                   else own["replica"][i] for i in range(len(params))]
        buffers = [torch.stack([p["buffers"][i] for p in saved]).mean(0) if len(saved) > 1
                   else own["buffers"][i] for i in range(len(self._buffers))]
        self.load_state_dict(own)
        for tensor, value in zip(params + self._buffers, list(replica) + list(buffers)):
            tensor.copy_(value)
        for i in index:
            self._trained[i] = True

    def _check_outer(self, state: dict[str, Any]) -> None:
        if (state["outer"] is None) != (self.outer is None):
            raise ValueError(
                "checkpoint and LocalSGD disagree on outer_optimizer: build LocalSGD with the "
                "same outer_optimizer setting the checkpoint was saved with"
            )
