"""A fully sharded unit's life in a step: the hooks that gather, free and reduce-scatter.

Forward: the unit's pre-forward hook all-gathers its parameters and registers the full tensors
on its modules; the post-forward hook frees them again (``reshard_after_forward``) and hooks the
outputs, so that the first gradient reaching an output gathers them once more before the unit's
own backward runs (from the second step on the gather of the next unit is started early, see
``prefetch``). Backward: each full parameter's post-accumulate-grad hook counts the
gradients; when the last one has arrived the unit frees its parameters and launches an
asynchronous reduce-scatter of its gradients, which overlaps with the backward of the units
before it. The root's end-of-backward callback waits for every reduction and writes each rank's
chunk into its shards' ``.grad`` (after an all-reduce across replicas under hybrid sharding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep._torch_compat import current_graph_task_id, queue_callback
from lockstep.ddp.replica_sync import ReplicaMismatchError, first_mismatch
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.fsdp import collectives
from lockstep.fsdp.agreement import OPTIONS, UnitSettings, settings_mismatch
from lockstep.fsdp.flat_param import FlatShard
from lockstep.fsdp.mixed_precision import MixedPrecisionPolicy
from lockstep.fsdp.prefetch import Prefetcher
from lockstep.fsdp.registry import attach, get_unit, set_owner
from lockstep.tensors import iter_tensors

__all__ = ["FSDPUnit", "RootState", "get_unit"]  # get_unit re-exported from registry



def _progress(group: dist.ProcessGroup | None, phase: str, new_step: bool = False) -> None:
    """Tell this rank's progress record where the step is (hang detection names a stuck rank
    with it); nothing without a process group."""
    if not dist.is_initialized():
        return
    found = group_progress(group)
    if new_step:
        found.begin_step(phase)
    else:
        found.set_phase(phase)


@dataclass
class RootState:
    """What the units under one root share during a step: the reductions still in flight."""

    units: list[FSDPUnit]
    pending: list[tuple[FSDPUnit, collectives.Pending, torch.Tensor]] = field(default_factory=list)
    callback_queued: bool = False
    prefetcher: Prefetcher = field(default_factory=Prefetcher)

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of backward: reduce what did not get every gradient, then land every reduction."""
        self.callback_queued = False
        for unit in reversed(self.units):
            if unit.backward_open:
                unit.post_backward()
        for unit, pending, reduced in self.pending:
            pending.wait()
            unit.emit("reduce-waited")
            unit.land(reduced)
        self.pending.clear()
        self.prefetcher.end_backward()
        if self.units:
            _progress(self.units[0].shard_group,
                      "after backward (optimizer step, data loading, next forward)")


def _unit_settings(named: list[tuple[str, FSDPUnit]], root: FSDPUnit) -> UnitSettings:
    """Each unit's options as the steps will use them (``reshard_after_forward=None`` resolved
    as the root's first forward resolves it), in plain values for the start-up exchange."""
    def plain(unit: FSDPUnit, option: str) -> Any:
        if option == "reshard_after_forward":
            value = unit.reshard_after_forward
            return unit is not root if value is None else value
        value = getattr(unit.mp_policy, option)
        return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value

    return [(name or "<root>", tuple(plain(unit, option) for option in OPTIONS))
            for name, unit in named]


def _same_everywhere(named: list[tuple[str, FSDPUnit]], group: dist.ProcessGroup | None,
                     root: FSDPUnit) -> None:
    """Raise on every rank of ``group`` if a rank's sharded parameters, or its units' options
    (``reshard_after_forward``, the mixed-precision policy), differ from rank 0's.

    Ranks that built different models would otherwise send gathers of different sizes, and
    gloo would abort one rank with a size error and reset the others' connections; ranks whose
    options differ run different collectives (a hang) or gathers of other dtypes. Checked
    once, at the root's first forward, in one exchange.
    """
    if collectives.group_size(group) == 1:
        return
    params = [(f"{name}.{slot.fqn}" if name else slot.fqn, tuple(slot.shape),
               str(slot.shard.dtype).replace("torch.", ""))
              for name, unit in named for slot in unit.flat.slots]
    mine = (params, _unit_settings(named, root))
    everyone: list[Any] = [None] * collectives.group_size(group)
    hang.run(group_progress(group), "fully_shard start-up parameter check",
             lambda: dist.all_gather_object(everyone, mine, group=group))
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
    for rank, (theirs, _) in zip(ranks, everyone):
        diff = first_mismatch(everyone[0][0], theirs)
        if diff is not None:
            raise ReplicaMismatchError(
                f"fully_shard: rank {rank} holds different parameters than rank {ranks[0]}: "
                f"{diff.replace('rank 0', f'rank {ranks[0]}')}. Every rank must build the same "
                "model (same code, same arguments) and shard it the same way"
            )
    differs = settings_mismatch([theirs for _, theirs in everyone], ranks)
    if differs is not None:
        raise ReplicaMismatchError(f"fully_shard: {differs}")


class FSDPUnit:
    """The sharding state of one module given to ``fully_shard``."""

    def __init__(
        self,
        module: nn.Module,
        flat: FlatShard,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.module, self.flat = module, flat
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True  # False: keep gathered for the next forward
        self.mp_policy = mp_policy
        self.root: RootState | None = None
        self.is_root = False
        self.requires_gradient_sync = True
        self.unsharded = False
        self._gathered_versions: tuple[int, ...] = ()  # the shards' versions at the last gather
        self.backward_open = False  # gathered for backward, gradients not yet reduced
        self.prefetch = True  # start the next unit's all-gather early (see ``prefetch``)
        self.listener: Callable[[str, str], None] | None = None  # see prefetch.record_events
        self.name = ""  # module path under the root, known once the root ran forward
        # An all-gather in flight: (pending, output, input kept alive until it finishes).
        self._gathering: tuple[collectives.Pending, torch.Tensor, torch.Tensor] | None = None
        self._ready = 0
        self._task = -1  # the graph task of the backward this unit's gradients come from
        # A gradient was accumulated by a nested backward (reentrant activation checkpointing
        # recomputes and differentiates its region in a backward of its own): such a unit's
        # parameters may be accumulated into more than once per backward, so counting them
        # cannot tell when the last has come; its reduction waits for the end of backward.
        self._nested = False
        attach(module, self)
        for slot in flat.slots:
            set_owner(slot.shard, self)
        # copy.deepcopy looks __deepcopy__ up on the instance: refuse with a message instead of
        # copying parameters whose storage the unit frees and swaps (that crashed the process).
        module.__dict__["__deepcopy__"] = self._refuse_deepcopy
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        self._hooked: set[int] = set()  # ids of the full tensors whose gradients are counted
        self._expected = 0  # gradients the backward of the last forward produces
        self._follow_trainable()

    def _follow_trainable(self) -> None:
        """Count the gradients of the parameters trainable now (``requires_grad`` may change
        after ``fully_shard``, between steps)."""
        trainable = self.flat.sync_trainable()
        for slot in trainable:
            if id(slot.full) not in self._hooked:
                slot.full.register_post_accumulate_grad_hook(self._on_grad)
                self._hooked.add(id(slot.full))
        self._expected = len(trainable)

    def _refuse_deepcopy(self, memo: Any) -> Any:
        raise RuntimeError(
            f"copy.deepcopy of a fully_shard-ed module ({type(self.module).__name__}) is not "
            "supported: its parameters are shards whose full storage is gathered and freed. "
            "Build a new model and load lockstep.fsdp.full_state_dict(model) into it instead"
        )

    # -- root -----------------------------------------------------------------------------------

    @torch.compiler.disable()  # the start-up check pickles objects: outside a compiled graph
    def _lazy_init_root(self) -> None:
        named = [(n, u) for n, m in self.module.named_modules() if (u := get_unit(m)) is not None]
        if dist.is_initialized():
            _same_everywhere(named, self.shard_group, self)
            if self.replicate_group is not None:
                _same_everywhere(named, self.replicate_group, self)
        state = RootState([u for _, u in named])
        for name, unit in named:
            unit.root, unit.name = state, name
            if unit.reshard_after_forward is None:  # torch's default: the root keeps its own
                unit.reshard_after_forward = unit is not self
        self.is_root = True

    def emit(self, event: str) -> None:
        """Tell the listener of :func:`lockstep.fsdp.record_events` what this unit just did."""
        if self.listener is not None:
            self.listener(event, self.name)

    # -- gather and free ------------------------------------------------------------------------

    def start_gather(self) -> None:
        """Start the asynchronous all-gather of the full parameters (no-op if gathered or going)."""
        if self.unsharded or self._gathering is not None:
            return
        if collectives.group_size(self.shard_group) != self.flat.size:
            raise RuntimeError(
                f"fully_shard: {type(self.module).__name__} was sharded across {self.flat.size} "
                f"rank(s) but its group now has {collectives.group_size(self.shard_group)}: it "
                "was sharded before the process group existed. Call "
                "torch.distributed.init_process_group (or lockstep.init_distributed) first, "
                "then build and shard the model"
            )
        out, local = self.flat.gather_output(), self.flat.gather_input()
        pending = collectives.Pending(None)
        if out.numel():
            pending = collectives.all_gather_into_tensor(out, local, self.shard_group, async_op=True)
        self._gathering = (pending, out, local)
        self.emit("gather-issued")

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this unit holds now, a prefetched gather in flight included."""
        held = sum(s.full.untyped_storage().nbytes() for s in self.flat.slots)
        if self._gathering is not None:
            held += self._gathering[1].untyped_storage().nbytes()
        return held

    def drop_gather(self) -> None:
        """Finish an all-gather nobody used and discard its result."""
        if self._gathering is not None:
            self._gathering[0].wait()
            self._gathering = None

    def unshard(self) -> None:
        """All-gather the full parameters into the modules (no-op when already there).

        Waits for a gather already started by a prefetch, else starts one and waits.
        """
        if (self.unsharded and not self.backward_open and current_graph_task_id() == -1
                and self._gathered_versions != self.flat.shard_versions()):
            # Kept gathered since a forward that no backward followed (the root keeps its
            # parameters after forward; an eval or no_grad forward), and the shards changed
            # since (an EMA update, a load_state_dict, a copy into parameters()): gathered
            # again. Until 2026-11-29 the stale gather was used, silently.
            self.reshard()
        if not self.unsharded:
            self.start_gather()
            assert self._gathering is not None
            pending, out, _ = self._gathering
            pending.wait()
            self._gathering = None
            self.flat.fill_full(out)
            self._gathered_versions = self.flat.shard_versions()
            self.unsharded = True
            self.emit("gather-waited")
        self.flat.use_full()

    def reshard(self) -> None:
        """Free the full parameters; the modules show the shards again."""
        self.flat.use_shards()
        if self.unsharded:
            self.flat.free_full()
            self.unsharded = False

    # -- hooks ----------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.root is None:
            self._lazy_init_root()
        assert self.root is not None
        if current_graph_task_id() != -1:  # recomputed in backward (activation checkpointing)
            self.unshard()  # kept until this unit's backward is over: see _post_forward
            return self.mp_policy.cast_inputs(args), self.mp_policy.cast_inputs(kwargs)
        if self.is_root:
            self.root.prefetcher.drop()  # gathers from before an optimizer step are stale
            if torch.is_grad_enabled():  # a training step: where a rank named stuck is
                _progress(self.shard_group, "forward", new_step=True)
        if not self.backward_open:
            self.flat.check_unchanged(type(module).__name__)
            self._follow_trainable()
        self.unshard()
        self.root.prefetcher.on_forward(self)
        self.emit("forward-begin")
        return self.mp_policy.cast_inputs(args), self.mp_policy.cast_inputs(kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.emit("forward-end")
        if self.is_root and torch.is_grad_enabled() and current_graph_task_id() == -1:
            _progress(self.shard_group, "after forward, before backward")
        if current_graph_task_id() != -1:
            # A forward recomputed during backward (activation checkpointing without early
            # stop runs the whole block again, hooks included): the backward about to run
            # needs the gathered parameters, which its post-backward frees. While this unit's
            # backward runs, its modules keep showing them (see _pre_backward).
            if not self.backward_open:
                self.flat.use_shards()
        elif self.reshard_after_forward:
            self.reshard()
        else:
            self.flat.use_shards()
        if torch.is_grad_enabled():
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if not self.backward_open:
            self.backward_open = True
            self._ready = 0
            self._task = current_graph_task_id()
            # The modules show the full parameters until post_backward, as torch's fully_shard
            # does: activation checkpointing inside the unit (checkpoint(self.mlp, x) in its
            # forward, or the root checkpointing one of its own layers) recomputes that part
            # during this backward by reading the modules' attributes, which showed the 1-D
            # shards here until 2026-11-29 (a shape error, or checkpoint's metadata check).
            self.unshard()
            assert self.root is not None
            if self.is_root:
                _progress(self.shard_group, "backward")
            self.root.prefetcher.on_backward(self)
            self.emit("backward-begin")
            self.root.queue_final_callback()

    def _on_grad(self, param: torch.Tensor) -> None:
        if current_graph_task_id() != self._task:
            self._nested = True  # from now on: reduced at the end of backward (finish_backward)
            return
        self._ready += 1
        if self.backward_open and not self._nested and self._ready == self._expected:
            self.post_backward()

    def post_backward(self) -> None:
        """Free the parameters and start reducing the gradients (or stash them, without sync)."""
        self.backward_open = False
        if self.reshard_after_backward:
            self.reshard()
        else:
            self.flat.use_shards()  # stays gathered: the next forward reuses it without a gather
        if not self.flat.trainable:
            return
        if not self.requires_gradient_sync:
            self.flat.stash_grads()
            return
        dtype = self.mp_policy.gradient_dtype(self.flat.trainable[0].shard.dtype)
        send = self.flat.grad_send(dtype)
        reduced = torch.empty(self.flat.reduce_numel, dtype=dtype, device=send.device)
        pending = collectives.reduce_scatter_tensor(reduced, send.view(-1), self.shard_group, async_op=True)
        self.emit("reduce-issued")
        assert self.root is not None
        self.root.pending.append((self, pending, reduced))

    def land(self, reduced: torch.Tensor) -> None:
        """Write a finished reduction into the shards' gradients (averaged across replicas)."""
        if self.replicate_group is not None and dist.get_world_size(self.replicate_group) > 1:
            reduced.div_(dist.get_world_size(self.replicate_group))
            collectives.all_reduce(reduced, self.replicate_group).wait()
        self.flat.set_shard_grads(reduced)
