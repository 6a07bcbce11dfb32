"""ZeroRedundancyOptimizer: each rank keeps optimizer state only for its shard of the parameters.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``. It wraps an ordinary
optimizer (Adam, SGD...) built over this rank's shard only; after that optimizer steps, each
owner broadcasts its updated parameters so every rank ends the step with the same model.
With ``reduce_gradients=True`` it also shards gradients (ZeRO-2): each gradient is reduced to
its owner only, instead of being all-reduced to everyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lockstep._torch_compat import optimizer_state_dict_hooks
from lockstep.ddp.replica_sync import ReplicaMismatchError
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.zero import state as zstate
from lockstep.zero.agreement import agree_on_target, settings, settings_mismatch
from lockstep.zero.broadcast import (
    attach_views,
    broadcast_buckets,
    global_ranks,
    make_buckets,
)
from lockstep.zero.gradients import carry_forward, clip_owned, reduce_to_owners
from lockstep.zero.partition import partition_groups

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

# Keys of a param group that are not hyperparameters, so are never copied between the views.
_NOT_HYPERPARAMETERS = ("params", "param_names")


class ZeroRedundancyOptimizer(Optimizer):
    """Shard an optimizer's state (ZeRO-1), and optionally the gradients (ZeRO-2), over ranks.

    Parameters are assigned to ranks greedily, largest first onto the least-loaded rank, so
    each holds about ``1/world_size`` of the bytes. ``param_groups`` lists every parameter
    and is the view learning-rate schedulers change; ``step()`` passes its hyperparameters on.

    Args:
        params: parameters or param-group dicts, the same on every rank in the same order.
        optimizer_class: the optimizer to run on the local shard, e.g. ``torch.optim.Adam``.
        process_group: the group to shard over (``None``: the default group).
        parameters_as_bucket_view: keep each owner's parameters in one flat buffer (parameters
            become views into it), so sharing them after a step needs no copy.
        overlap_with_ddp: torch's overlap with DDP's backward; not supported (``ValueError``).
        reduce_gradients: ZeRO-2: ``step()`` first averages each gradient onto its owner and
            drops the others. Use with an unwrapped model, or with DDP inside ``no_sync()``;
            the parameters are broadcast from rank 0 at construction so all ranks start equal.
        **defaults: the optimizer's arguments (``lr=...``), passed to ``optimizer_class``.

    Raises:
        TypeError: ``optimizer_class`` is not a subclass of ``torch.optim.Optimizer``.
        ValueError: no parameters, a sparse parameter, parameters on several devices (or on
            the CPU with NCCL), or ``overlap_with_ddp=True``.
        RuntimeError: no process group.
        ReplicaMismatchError: ranks passed different parameters, optimizer classes or
            hyperparameters (a RuntimeError and a ValueError).

    Example::

        lockstep.init_distributed()
        model = lockstep.DistributedDataParallel(Net())
        opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        reduce_gradients: bool = False,
        **defaults: Any,
    ) -> None:
        _check_arguments(optimizer_class, overlap_with_ddp)
        self._initialized = False  # add_param_group runs inside Optimizer.__init__
        self._optimizer_class = optimizer_class
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._ranks = global_ranks(process_group)
        self._bucket_view = parameters_as_bucket_view
        self._reduce_gradients = reduce_gradients
        self._consolidated: dict[int, dict] | None = None
        self._steps = 0  # steps taken, to tell a stale consolidated state from a fresh one
        self._consolidated_at = 0
        self._reduced = False  # ZeRO-2: clip_grad_norm_ already reduced this step's gradients
        super().__init__(_nonempty(params), defaults)
        self._check_parameters()
        self._owners, loads = partition_groups(self._group_sizes(), self.world_size)
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self.state = self.optim.state  # the shard's state: what this rank really holds
        # The local optimizer's defaults for what was not given (betas, momentum...): a
        # scheduler that checks them, as OneCycleLR(cycle_momentum=True) does, finds them
        # (torch's ZeRO holds only the arguments given, and both refused it until 2026-11-29).
        self.defaults = {**self.optim.defaults, **self.defaults}
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._build_buckets()
        if reduce_gradients:
            self._broadcast_from_rank0()
        logger.debug("rank %d of %d owns %d of %d bytes", self.rank, self.world_size,
                     loads[self.rank], sum(loads))
        self._initialized = True

    # -- torch's read-only attributes -------------------------------------------------------

    @property
    def parameters_as_bucket_view(self) -> bool:
        """Whether parameters are views of one flat bucket per device and owner (as torch's)."""
        return self._bucket_view

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group (``rank`` is its rank in the optimizer's)."""
        return self._ranks[self.rank]

    @property
    def initialized(self) -> bool:
        """True once construction finished (torch's attribute)."""
        return self._initialized

    # -- the step --------------------------------------------------------------------------

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, **kwargs: Any
    ) -> float | None:
        """Step this rank's shard, then share the updated parameters with every rank.

        Every rank must call it (it communicates). With ``reduce_gradients=True`` a closure
        is evaluated once before the gradients are reduced. Extra keyword arguments go to the
        local optimizer's ``step``, as in torch.
        """
        loss = None
        if self._reduce_gradients:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
                closure = None
                self._reduced = False  # the closure made new local gradients
            if not self._still_reduced():
                reduce_to_owners(self._buckets, self.rank, self.process_group, self._ranks)
            self._reduced = False
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        if closure is not None:
            stepped = self.optim.step(closure=closure, **kwargs)
        else:
            stepped = self.optim.step(**kwargs)
        broadcast_buckets(self._buckets, self.rank, self.process_group, self._ranks)
        if self._reduce_gradients:
            carry_forward(self._buckets, self.rank, self.world_size)
        self._steps += 1
        # Some optimizers change their own hyperparameters; keep the full view in step.
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        return loss if loss is not None else stepped

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by the norm of the whole averaged gradient; return that norm.

        Call it between backward and :meth:`step`, on every rank (it communicates with
        ``reduce_gradients=True``). With ZeRO-1 the gradients are already averaged on every
        rank (DDP), and this is ``torch.nn.utils.clip_grad_norm_`` over all the parameters.
        With ZeRO-2 (``reduce_gradients=True``) the ranks hold their own, not yet averaged,
        gradients until ``step()``, so torch's function would clip each rank by its own norm:
        this one reduces them to their owners first (``step()`` then does not reduce again) and
        scales by the norm of the averaged gradient, as a single process would.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        if not self._reduce_gradients:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        if not self._still_reduced():
            reduce_to_owners(self._buckets, self.rank, self.process_group, self._ranks)
            self._reduced = True
        return clip_owned(self._buckets, self.rank, self.process_group, max_norm, norm_type,
                          error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's; the next clip or step reduces the new ones."""
        super().zero_grad(set_to_none)
        self._reduced = False

    def _still_reduced(self) -> bool:
        """Are the gradients those :meth:`clip_grad_norm_` reduced, with no backward since?

        A step skipped after clipping (a non-finite norm, GradScaler's skip) leaves the flag
        set; ``zero_grad`` clears it, and a gradient on a parameter this rank does not own
        (the reduction left those ``None``) shows a backward ran since.
        """
        return self._reduced and all(
            p.grad is None for bucket in self._buckets if bucket.owner != self.rank
            for p in bucket.params)

    def join_hook(self, **kwargs: Any) -> Any:
        """Refuse ``torch.distributed.algorithms.Join([model, optimizer])`` with a reason.

        Not a ``Joinable`` yet (docs/zero.md); torch's ``Join`` asks for this hook first, so its
        users get this message instead of a bare ``AttributeError``.
        """
        raise TypeError(
            "lockstep.ZeroRedundancyOptimizer is not a Joinable yet, so Join cannot stand in "
            "for its step() on a rank that ran out of data: with uneven inputs, have every rank "
            "run the same number of steps (e.g. the smallest batch count, agreed with "
            "dist.all_reduce(..., op=dist.ReduceOp.MIN)); docs/zero.md"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (e.g. layers unfrozen while fine-tuning); every rank must call it alike.

        Earlier parameters keep their owners, so no optimizer state moves. The new parameters
        are checked across ranks as at construction, and with ``reduce_gradients=True`` taken
        from rank 0 (no DDP broadcast keeps them equal).
        """
        super().add_param_group(param_group)
        if not self._initialized:
            return
        try:
            self._check_parameters()
        except Exception:
            self.param_groups.pop()  # refused on every rank: the group is not half added
            raise
        self._owners, _ = partition_groups(self._group_sizes(), self.world_size)
        group = self.param_groups[-1]
        local = [p for p, owner in zip(group["params"], self._owners[-1]) if owner == self.rank]
        self.optim.add_param_group({**_hyperparameters(group), "params": local})
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._build_buckets()
        if self._reduce_gradients:
            broadcast_buckets(make_buckets([list(group["params"])]), self.rank,
                              self.process_group, self._ranks)

    # -- checkpoints -----------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every shard's state on rank ``to``; call it on every rank before ``state_dict()``.

        Raises:
            ValueError: ``to`` is not a rank of the process group, or differs across ranks
                (on every rank, after one small exchange, instead of a hang in the gather).
        """
        agree_on_target(to, self.process_group, self._ranks)
        owned = self._owned_positions()
        local_to_global = [position for positions in owned for position in positions]
        shard = zstate.shard_state(self.optim.state_dict()["state"], local_to_global)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        hang.run(group_progress(self.process_group), "ZeRO consolidate_state_dict gather",
                 lambda: dist.gather_object(shard, gathered, dst=self._ranks[to],
                                            group=self.process_group))
        self._consolidated, self._consolidated_at = None, self._steps
        if gathered is not None:
            self._consolidated = {k: v for part in gathered for k, v in part.items()}

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, in a plain optimizer's format, as last consolidated.

        Hooks registered with ``register_state_dict_pre_hook``/``..._post_hook`` run as
        torch's ``Optimizer.state_dict`` runs them.

        Raises:
            RuntimeError: this rank did not receive the state in ``consolidate_state_dict``,
                or the optimizer stepped since (the state would be stale).
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {self.rank} holds no consolidated optimizer state: call "
                f"consolidate_state_dict(to={self.rank}) on every rank before state_dict()"
            )
        if self._consolidated_at != self._steps:
            raise RuntimeError(
                f"the consolidated optimizer state is from step {self._consolidated_at} but the "
                f"optimizer has taken {self._steps} steps: call consolidate_state_dict() on every "
                "rank again before state_dict()"
            )
        hooks = optimizer_state_dict_hooks(self)
        for pre_hook in hooks.save_pre:
            pre_hook(self)
        state_dict = zstate.full_state_dict(self.param_groups, self._consolidated)
        for post_hook in hooks.save_post:
            changed = post_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict, saved at any world size or by a plain optimizer.

        Each rank keeps only its shard's state. Raises ``ValueError`` if the groups differ.
        Hooks registered with ``register_load_state_dict_pre_hook``/``..._post_hook`` run as
        torch's ``Optimizer.load_state_dict`` runs them.
        """
        hooks = optimizer_state_dict_hooks(self)
        for pre_hook in hooks.load_pre:
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        zstate.check_compatible(state_dict, [len(g["params"]) for g in self.param_groups])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(_hyperparameters(saved))
        self.optim.load_state_dict(zstate.local_state_dict(state_dict, self._owned_positions()))
        self._consolidated = None  # it described the state before this load
        self.state = self.optim.state  # load_state_dict replaced the shard's state dict
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        for post_hook in hooks.load_post:
            post_hook(self)

    # -- helpers ---------------------------------------------------------------------------

    def _group_sizes(self) -> list[list[int]]:
        return [[p.numel() * p.element_size() for p in g["params"]] for g in self.param_groups]

    def _local_groups(self) -> list[dict[str, Any]]:
        """One group per wrapper group (possibly empty), holding the parameters this rank owns."""
        return [
            {**_hyperparameters(group), "params": [
                p for p, owner in zip(group["params"], owners) if owner == self.rank
            ]}
            for group, owners in zip(self.param_groups, self._owners)
        ]

    def _owned_positions(self) -> list[list[int]]:
        """Global positions (state-dict numbering) of this rank's parameters, per group."""
        lengths = [len(g["params"]) for g in self.param_groups]
        return [
            [pos for pos, owner in zip(positions, owners) if owner == self.rank]
            for positions, owners in zip(zstate.global_indices(lengths), self._owners)
        ]

    def _params_by_owner(self) -> list[list[torch.Tensor]]:
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for group, owners in zip(self.param_groups, self._owners):
            for p, owner in zip(group["params"], owners):
                by_owner[owner].append(p)
        return by_owner

    def _build_buckets(self) -> None:
        self._buckets = make_buckets(self._params_by_owner())
        if self._bucket_view:
            for bucket in self._buckets:
                attach_views(bucket)

    def _broadcast_from_rank0(self) -> None:
        every = [p for group in self.param_groups for p in group["params"]]
        broadcast_buckets(make_buckets([every]), self.rank, self.process_group, self._ranks)

    def _check_parameters(self) -> None:
        """Same device for all; same shapes and dtypes on every rank (else the collectives hang);
        the same optimizer class and hyperparameters (else each shard steps with its owner's)."""
        params = [(g, i, p) for g, group in enumerate(self.param_groups)
                  for i, p in enumerate(group["params"])]
        if not params:
            raise ValueError("ZeroRedundancyOptimizer got parameter groups without any parameter")
        device = params[0][2].device
        for g, i, p in params:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    f"parameter {i} of group {g} is a sparse tensor ({p.layout}); "
                    "ZeroRedundancyOptimizer shards dense parameters only: keep sparse "
                    "parameters in a separate plain optimizer"
                )
            if p.device != device:
                raise ValueError(
                    f"parameter {i} of group {g} is on {p.device} but parameter 0 is on {device}; "
                    "move the model to this rank's device before building the optimizer"
                )
        _check_backend(str(dist.get_backend(self.process_group)), device)
        signature = [(g, i, tuple(p.shape), str(p.dtype)) for g, i, p in params]
        everyone: list[Any] = [None] * self.world_size
        # After construction only the new group is compared: an optimizer that changes its
        # own hyperparameters in step() may have changed the earlier groups on its shard only.
        first = len(self.param_groups) - 1 if self._initialized else 0
        mine = (signature, _checksums([p for _, _, p in params]), settings(
            self._optimizer_class, [_hyperparameters(g) for g in self.param_groups[first:]], first))
        hang.run(group_progress(self.process_group), "ZeRO start-up parameter check",
                 lambda: dist.all_gather_object(everyone, mine, group=self.process_group))
        ours, our_sums, _ = everyone[0]
        for rank, (theirs, their_sums, _) in enumerate(everyone):
            if theirs != ours:
                raise ReplicaMismatchError(_mismatch_message(rank, ours, theirs))
            if their_sums != our_sums and sorted(their_sums) == sorted(our_sums):
                raise ReplicaMismatchError(_order_message(rank, signature, our_sums, their_sums))
        differs = settings_mismatch([theirs[2] for theirs in everyone], self._ranks)
        if differs is not None:
            raise ReplicaMismatchError(f"ZeroRedundancyOptimizer: {differs}")


def _check_arguments(optimizer_class: Any, overlap_with_ddp: bool) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        got = (
            f"an instance of {type(optimizer_class).__name__}; pass the class itself, "
            "not an instance"
            if isinstance(optimizer_class, Optimizer)
            else f"{optimizer_class!r}"
        )
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.Adam, "
            f"got {got}"
        )
    if overlap_with_ddp:
        raise ValueError(
            "overlap_with_ddp=True is not supported by lockstep; use reduce_gradients=True "
            "(ZeRO-2) to cut gradient traffic and memory instead"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroRedundancyOptimizer needs a process group: call lockstep.init_distributed() first"
        )


def _check_backend(backend: str, device: torch.device) -> None:
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"the parameters are on {device} but the process group uses NCCL, which needs CUDA "
            "tensors; move the model to this rank's GPU (info.device) before building the optimizer"
        )


def _nonempty(params: Iterable[Any]) -> list[Any]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single tensor")
    try:
        listed = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of tensors or dicts (e.g. model.parameters()), got "
            f"{type(params).__name__}"
        ) from None
    if not listed:
        raise ValueError(
            "ZeroRedundancyOptimizer got an empty parameter list; pass model.parameters() "
            "(a generator is consumed once: build it anew for each optimizer)"
        )
    return listed


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def _copy_hyperparameters(sources: list[dict], targets: list[dict]) -> None:
    for source, target in zip(sources, targets):
        target.update(_hyperparameters(source))


def _checksums(params: list[torch.Tensor]) -> list[float]:
    """Each parameter's sum, to tell the same values in another order from other values.

    Parameters of the same shapes passed in another order pass the shape check, and the
    broadcast after each step would then write one layer's weights into another. Where the
    ranks' sums are the same numbers in another order, the order differs; where they simply
    differ (each rank initialised its own model, which DDP or ``reduce_gradients`` makes equal
    later), nothing is said. One value per parameter, read in one transfer."""
    with torch.no_grad():
        sums = torch.stack([(torch.view_as_real(p.detach()) if p.is_complex() else p.detach())
                            .sum(dtype=torch.float64) for p in params])
    return [float(x) for x in sums.cpu().tolist()]


def _order_message(rank: int, signature: list, ours: list[float], theirs: list[float]) -> str:
    index = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    g, i, shape, _ = signature[index]
    return (
        f"rank {rank} passed different parameters from rank 0: the same values in another order "
        f"(first at parameter {i} of group {g}, shape {shape}); every rank must build the same "
        "model and pass its parameters in the same order, or each step's broadcast would write "
        "one parameter into another"
    )


def _mismatch_message(rank: int, ours: list, theirs: list) -> str:
    first = next(
        (f"{a} vs {b}" for a, b in zip(ours, theirs) if a != b),
        f"{len(ours)} vs {len(theirs)} parameters",
    )
    return (
        f"rank {rank} passed different parameters from rank 0 (first difference, as (group, "
        f"index, shape, dtype): {first}); every rank must build the same model and pass its "
        "parameters in the same order"
    )
