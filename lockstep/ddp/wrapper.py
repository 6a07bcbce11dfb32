"""lockstep.DistributedDataParallel: one process per device, gradients averaged during backward.

The wrapper owns the user-facing contract (torch 2.13's constructor, ``.module``, ``no_sync``,
``register_comm_hook``, torch's ``Joinable`` members, pickling, state dicts without ``module.``);
argument checks live in ``arguments.py``, bucketing in ``bucket.py``, the reduction in
``reducer.py``, start-up agreement in ``replica_sync.py``, uneven inputs in ``join.py`` and ``joinable.py``.

It is one class whose methods are spread over three bases by concern: ``persistence.py``
(pickling, state dicts), ``profiling.py`` (the doctor's marks) and ``joinable.py`` (torch's
``Joinable``). None of them is used on its own; each lists, as class annotations under "Set by
DistributedDataParallel", the attributes it reads, and only ``__init__`` here sets them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from lockstep import profilers
from lockstep._torch_compat import ddp_ignored_names, preserve_version_counter, set_ddp_ignored_names
from lockstep.comm.compression import ReduceDtypeState, reduce_dtype_hook
from lockstep.comm.fp32_accumulate import FP32AccumulateState, fp32_accumulate_hook
from lockstep.comm.hooks import check_annotations, returns_future
from lockstep.ddp import arguments
from lockstep.ddp.compiled import CompiledTwin, active_backend
from lockstep.ddp.delayed import DelayedAllReduce, hook_param_name, split_delayed
from lockstep.ddp.join import UnevenInputs
from lockstep.ddp.joinable import JoinableDDP
from lockstep.ddp.persistence import PersistentDDP
from lockstep.ddp.profiling import ProfiledDDP
from lockstep.ddp.reducer import Reducer
from lockstep.ddp.replica_sync import (
    broadcast_coalesced,
    buffer_slots,
    live_buffers,
    verify_same_parameters,
)
from lockstep.ddp.sparse import expects_sparse_gradients
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.distributed import global_rank
from lockstep.dp.scatter_gather import gather, scatter_kwargs
from lockstep.tensors import move_to

__all__ = ["DistributedDataParallel"]

def _check_not_wrapped(module: nn.Module) -> None:
    """Refuse a module that holds a DDP already: two reducers averaging the same gradients,
    with gradient views (lockstep's default), gave wrong gradients that changed from run to
    run (torch's DDP raises at the first backward there; without views both average twice)."""
    for name, sub in module.named_modules():
        if isinstance(sub, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            where = f"its submodule '{name}'" if name else "the module"
            raise TypeError(
                f"DistributedDataParallel: {where} is already a {type(sub).__name__}; wrap the "
                "plain model once (DistributedDataParallel(model), not of a wrapped one)"
            )


class DistributedDataParallel(PersistentDDP, ProfiledDDP, JoinableDDP):
    """Data parallelism across processes: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    Every rank holds a replica; parameters and buffers are broadcast from rank 0 once, and the
    gradients of each backward pass are averaged over ranks by bucketed asynchronous all-reduces
    that overlap the rest of backward. In a world of one it communicates nothing. The arguments
    are torch 2.13's, in torch's order; docs/torch-compatibility.md lists where lockstep differs.

    Args:
        module: the model, already on this rank's device.
        device_ids: ``[device]`` for a single-device CUDA module (inputs are moved there), or None.
        output_device: accepted for a CUDA module; outputs stay where the module puts them.
        dim: the batch dimension for :meth:`scatter` / :meth:`gather`.
        broadcast_buffers: torch's older name for ``forward_sync_buffers``; ``False`` also skips
            the buffers at construction (torch 2.13 does the same).
        init_sync: check that ranks hold the same parameters and broadcast rank 0's parameters
            and buffers at construction. ``False`` skips both: the ranks must already agree.
        process_group: the group to average over; None means the default group.
        bucket_cap_mb: bucket size in MiB (the first bucket is 1 MiB so reduction starts early).
        find_unused_parameters: tolerate parameters that receive no gradient in an iteration.
        check_reduction: deprecated in torch and without effect; a FutureWarning says so.
        gradient_as_bucket_view: ``.grad`` tensors are views of the bucket buffers (default True:
            no second copy of gradient memory; torch's default is False).
        static_graph: the graph is the same every iteration: the first backward records which
            parameters get a gradient and how many times (a block checkpointed twice), later
            ones rely on it (no search for unused parameters).
        delay_all_reduce_named_params: ``(name, parameter)`` pairs averaged apart from the
            buckets, in one all-reduce started when ``param_to_hook_all_reduce``'s gradient is
            computed (see ``delayed.py``).
        param_to_hook_all_reduce: the parameter whose gradient starts that all-reduce.
        mixed_precision: torch's ``_MixedPrecision``; ``reduce_dtype`` is honoured (gradients are
            summed and divided in that dtype, as torch does); ``param_dtype``/``buffer_dtype``
            raise (use ``torch.autocast``).
        device_mesh: a 1-D ``DeviceMesh`` whose group is averaged over (instead of
            ``process_group``).
        skip_all_reduce_unused_params: accepted; lockstep still reduces the (zero) gradients of
            unused parameters, so results are the same as torch's, without its saving.
        bucket_cap_mb_list: torch's per-bucket sizes; lockstep's buckets all take the largest.
        batched_grad_copy: accepted; a kernel-count optimisation for CUDA with the same results.
        forward_sync_buffers: broadcast rank 0's buffers before each forward (default True);
            buffers are broadcast at construction either way.
        reduce_dtype: lockstep's extension, keyword only: gradients travel in this dtype (e.g.
            ``torch.bfloat16``, half the bytes) and their mean is added up in fp32, so unlike
            ``mixed_precision``'s it does not drift as ranks are added; ``.grad`` stays fp32.
            Installs :func:`lockstep.comm.fp32_accumulate_hook` (docs/compression-and-local-sgd.md).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a size that is not a number.
        ValueError: a bad argument (the message names it).
        ReplicaMismatchError: ranks hold different parameters (a RuntimeError and a ValueError;
            the message names rank and parameter), or were given different options that shape
            communication (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``,
            ``broadcast_buffers``…; the message names the option and each rank's value). A comm
            hook or ``_set_static_graph()`` comes later and is not compared: register the same
            hook, and call it, on every rank.
        RuntimeError: no process group exists, or the module has no trainable parameter.

    Example::

        info = lockstep.init_distributed()
        model = lockstep.DistributedDataParallel(Net().to(info.device))
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # .grad is now the mean over ranks
            opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        arguments.check_module(module)
        _check_not_wrapped(module)
        self._bucket_cap_bytes = arguments.bucket_cap_bytes(bucket_cap_mb, bucket_cap_mb_list)
        self._reduce_dtype = arguments.check_mixed_precision(mixed_precision)
        self.reduce_dtype = arguments.check_reduce_dtype(reduce_dtype, self._reduce_dtype)
        if check_reduction:
            arguments.warn_check_reduction()
        arguments.warn_virtual_shards_unused()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call lockstep.init_distributed() "
                "first (it works under lockstep run, torchrun, srun and plain python)."
            )
        self.module = module
        self.process_group = arguments.resolve_process_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        self.dim = dim
        self.forward_sync_buffers, sync_buffers_at_init = arguments.buffer_sync_flags(
            broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters or static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.mixed_precision = mixed_precision
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._clock = None
        self._profile_hooks: list[Any] = []
        self._arrivals = None
        self._uneven: UnevenInputs | None = None  # lockstep's join()
        self._torch_join: UnevenInputs | None = None  # torch's Join([...]), through join_hook
        self._hook_registered = False
        ignored = ddp_ignored_names(module)  # torch's _set_params_and_buffers_to_ignore_for_model
        trainable, delayed = split_delayed(
            _unique_trainable(module, ignored), delay_all_reduce_named_params, param_to_hook_all_reduce)
        if not trainable and not delayed:
            raise RuntimeError(
                "DistributedDataParallel: the module has no parameter with requires_grad=True; "
                "there is nothing to synchronise. Wrap a trainable model."
            )
        self.device = (trainable or [("", delayed[0])])[0][1].device
        self.device_type = self.device.type
        self._check_devices(trainable)
        self.device_ids = arguments.check_device_ids(device_ids, output_device, self.device)
        # As torch: a single-device CUDA model's outputs default to its device.
        self.output_device = (None if self.device_ids is None else
                              output_device if output_device is not None else self.device_ids[0])
        self._buffer_slots = buffer_slots(module, ignored)
        self._trainable_names = [n for n, _ in trainable]
        self._delayed_names = [n for n, _ in delay_all_reduce_named_params or []]
        self._hook_param_name = hook_param_name(module, param_to_hook_all_reduce)
        self._connect()
        if init_sync and self.world_size > 1:
            buffers = ([(n, b) for n, b in module.named_buffers() if n not in ignored]
                       if sync_buffers_at_init else [])
            params = [(n, p) for n, p in module.named_parameters() if n not in ignored]
            # A rank that never comes (stuck, or gone before wrapping) is named, not waited on
            # until the backend's anonymous timeout.
            progress = group_progress(self.process_group)
            options = arguments.communication_options(
                find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
                broadcast_buffers=sync_buffers_at_init,
                forward_sync_buffers=self.forward_sync_buffers,
                mixed_precision_dtype=self._reduce_dtype, reduce_dtype=self.reduce_dtype,
                delayed_names=self._delayed_names)
            hang.run(progress, "DDP start-up parameter check",
                     lambda: verify_same_parameters(params, self.process_group, buffers, options))
            state = [p.detach() for _, p in params] + [b.detach() for _, b in buffers]
            hang.run(progress, "DDP start-up broadcast from rank 0",
                     lambda: broadcast_coalesced(state, self._src, self.process_group))
        # LOCKSTEP_PROFILE=dir, set by `lockstep doctor`: the doctor's answer (lockstep.profilers)
        settings = profilers.current().settings_from_env()
        if settings is not None:
            self.enable_profiling(**settings)

    def _connect(self) -> None:
        """Everything tied to the process group: rebuilt after unpickling."""
        self.world_size = dist.get_world_size(self.process_group)
        self._src = global_rank(self.process_group, 0)  # rank 0 of the group, globally
        self._reducer: Reducer | None = None
        self._delayed: DelayedAllReduce | None = None
        self._twin = CompiledTwin(self.module, self.plan_buckets)  # torch.compile's bucket split
        if self.world_size == 1:
            return
        named = dict(self.module.named_parameters())
        if self._trainable_names:
            self._reducer = self._new_reducer()
        if self._delayed_names:
            self._delayed = DelayedAllReduce([named[n] for n in self._delayed_names],
                                             named[self._hook_param_name], self.process_group)
        if self._reduce_dtype is not None and self._reducer is not None:
            state = ReduceDtypeState(self.process_group, reduce_dtype=self._reduce_dtype)
            self._reducer.comm_hook, self._reducer.comm_state = reduce_dtype_hook, state
            self._hook_registered = True
        elif self.reduce_dtype is not None and self._reducer is not None:
            wire = FP32AccumulateState(self.process_group, wire_dtype=self.reduce_dtype)
            self._reducer.comm_hook, self._reducer.comm_state = fp32_accumulate_hook, wire
            self._hook_registered = True

    def _new_reducer(self) -> Reducer:
        named = dict(self.module.named_parameters())
        params = [named[n] for n in self._trainable_names]
        return Reducer(
            params, self._trainable_names, self.process_group, self._bucket_cap_bytes,
            self.find_unused_parameters, self.gradient_as_bucket_view, static_graph=self.static_graph,
            expect_sparse=expects_sparse_gradients(self.module, params),
        )

    def _set_static_graph(self) -> None:
        """torch's older way to ask for ``static_graph=True``, after construction and before the
        first forward (gradient-checkpointing recipes call it); the constructor argument is
        the better way, as torch's docs say (and it is compared across ranks at construction;
        this call is not: call it on every rank, or gloo aborts the first backward).

        Raises:
            RuntimeError: a forward has already run.
        """
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        old = self._reducer
        if old is not None and old.started:
            raise RuntimeError(
                "DistributedDataParallel._set_static_graph() must be called before the first "
                "forward; pass static_graph=True to the constructor instead"
            )
        self.static_graph = True
        self.find_unused_parameters = True  # as the constructor sets it for static_graph
        if old is None:
            return
        old.remove_hooks()
        self._reducer = new = self._new_reducer()
        new.comm_hook, new.comm_state, new.clock = old.comm_hook, old.comm_state, old.clock

    _unpicklable = ("process_group", "device_mesh", "_reducer", "_delayed", "_uneven",
                    "_torch_join", "_clock", "_profile_hooks", "_arrivals", "_twin")

    def _reattach(self) -> None:
        """After unpickling: the default group, no join or profiling, the reducer rebuilt."""
        self.process_group = arguments.resolve_process_group(None, None)  # the default group
        self.device_mesh = None
        self._uneven = self._torch_join = self._clock = self._arrivals = None
        self._profile_hooks = []
        Joinable.__init__(self)
        self._connect()

    def _check_devices(self, named: list[tuple[str, nn.Parameter]]) -> None:
        for name, p in named:
            if p.device != self.device:
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} is on {p.device} but "
                    f"{named[0][0]!r} is on {self.device}; lockstep's DDP drives one device per "
                    "process. Move the whole model with model.to(device) before wrapping."
                )
        backend = str(dist.get_backend(self.process_group))
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"DistributedDataParallel: the model is on {self.device} but the process group "
                "uses NCCL, which needs CUDA tensors. Call model.to(info.device) before wrapping."
            )

    # ---- forward -------------------------------------------------------------------------
    # Under torch.compile this frame is skipped, not traced (no graph break): with nothing to
    # synchronise the module is compiled as it is called; otherwise the bookkeeping runs as
    # Python, as torch's DDP forward does, and the module runs through a twin compiled in pieces
    # that end at bucket boundaries, so all-reduces overlap backward (see compiled.py).
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if (self._reducer is None and self.device_ids is None
                and self._uneven is None and self._torch_join is None and self._delayed is None):
            return self.module(*inputs, **kwargs)
        return self._synced_forward(active_backend(self.module), inputs, kwargs)

    @torch.compiler.disable()
    def _synced_forward(self, compile_with: Any, inputs: tuple, kwargs: dict) -> Any:
        reducer = self._reducer
        if self.device_ids is not None:
            moved_inputs, moved_kwargs = self.to_kwargs(inputs, kwargs, self.device_ids[0])
            inputs, kwargs = moved_inputs[0], moved_kwargs[0]
        grad_enabled = torch.is_grad_enabled()
        sync = grad_enabled and self.require_backward_grad_sync
        src = self._src
        join = self._uneven
        if join is None and self._torch_join is not None and self._join_config.enable:
            Join.notify_join_context(self)  # torch's generic Join counts the active ranks
            join = self._torch_join
        if join is not None:
            src = join.announce(sync)
        if self.world_size > 1 and self.will_sync_module_buffers():
            self.sync_module_buffers(src)
        if self._delayed is not None and grad_enabled:
            self._delayed.before_forward(sync)
        if self._clock is not None and grad_enabled and not torch.compiler.is_compiling():
            self._clock.forward_synced()
        output = self._twin(compile_with, *inputs, **kwargs)
        if reducer is not None and grad_enabled:
            reducer.prepare_for_backward(self.require_backward_grad_sync, output)
        # As torch: the forward after a no_sync forward does not broadcast buffers.
        self.require_forward_param_sync = sync
        return output

    def scatter(self, inputs: tuple, kwargs: dict | None, device_ids: Sequence[Any]) -> tuple:
        """torch's hook for splitting inputs over ``device_ids`` along ``dim``."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs: tuple, kwargs: dict | None, device_id: Any) -> tuple:
        """``((inputs,), (kwargs,))`` moved to ``device_id`` of this model's device type."""
        device = (torch.device(self.device_type, device_id) if isinstance(device_id, int)
                  else torch.device(device_id))
        return (move_to(tuple(inputs), device),), (move_to(dict(kwargs or {}), device),)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        """torch's hook for concatenating per-device outputs along ``dim``."""
        return gather(outputs, output_device, dim=self.dim)

    # ---- buffers -------------------------------------------------------------------------
    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers (torch's rule)."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and bool(self._buffer_slots))

    def sync_module_buffers(self, src: int) -> None:
        """Broadcast the module's buffers from global rank ``src`` (rank 0, or an active rank).

        Buffers are looked up by name each time, so one reassigned in ``forward``
        (``self.buf = self.buf + 1``) is still the one broadcast.
        """
        buffers = live_buffers(self._buffer_slots)
        if buffers:
            # Keep version counters: a second forward before backward (GAN, contrastive) would
            # otherwise invalidate the buffers the first one saved for backward (as torch does).
            with preserve_version_counter(buffers):
                if self._reducer is None:
                    broadcast_coalesced(buffers, src, self.process_group)
                else:  # a rank that never arrives is named
                    hang.run(self._reducer.progress, "DDP buffer broadcast",
                             lambda: broadcast_coalesced(buffers, src, self.process_group))

    # ---- the seam for torch.compile ------------------------------------------------------
    def plan_buckets(self, order: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """The gradient buckets, in launch order, for a backward finishing gradients in ``order``.

        The seam for torch.compile's graph split: before the first synchronised backward fixes
        the layout, ``order`` is proposed as the order to build buckets in; afterwards the fixed
        buckets are returned. Parameters lockstep does not bucket are left out. Empty in a
        world of one.
        """
        reducer = self._reducer
        if reducer is None:
            return []
        index = {id(p): i for i, p in enumerate(reducer.params)}
        buckets = reducer.plan_buckets([index[id(p)] for p in order if id(p) in index])
        return [[reducer.params[i] for i in bucket] for bucket in buckets]

    @property
    def compiled_pieces(self) -> list[list[list[nn.Parameter]]]:
        """Under torch.compile: per graph compiled, the parameters each piece's backward finishes.

        Pieces in forward order; the split ends them at the buckets of :meth:`plan_buckets`.
        """
        return [graph for splitter in self._twin.splitters() for graph in splitter.pieces]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Sequence[str]) -> None:
        """torch's way to leave parameters and buffers out of DDP, called before wrapping.

        ``params_and_buffers_to_ignore`` are fully qualified names in ``module`` (``"head.weight"``):
        those parameters are not broadcast at construction and their gradients are not
        all-reduced (each rank keeps its own); those buffers are never broadcast. torch's
        class reads and writes the same attribute, so either class may set it for the other.
        """
        set_ddp_ignored_names(module, params_and_buffers_to_ignore)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronised backward averages the sum.

        The forward must run inside the context, as with torch's DDP.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def use_process_group(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Average over ``process_group`` from now on (None: the default group, as it is now).

        lockstep's own (torch's DDP has no such method): :class:`lockstep.Survivors` calls it
        when the world changes under a running job. The reducer is rebuilt on the new group
        and the old one's gradient hooks removed; the parameters are not broadcast (the caller
        brings the replicas level). Call it between steps, never inside a backward.

        Raises:
            RuntimeError: a comm hook registered with :meth:`register_comm_hook` (its state
                names the old group), or ``delay_all_reduce_named_params`` (its hook is tied
                to one group): build a new DistributedDataParallel instead.
        """
        user_hook = self._hook_registered and self._reduce_dtype is None and self.reduce_dtype is None
        if user_hook or self._delayed_names:
            raise RuntimeError(
                "use_process_group: this model has "
                + ("a registered comm hook" if user_hook else "delay_all_reduce_named_params")
                + ", whose state is tied to the old process group; build a new "
                "DistributedDataParallel on the new group instead."
            )
        if self._reducer is not None:
            self._reducer.remove_hooks()
        self.process_group = arguments.resolve_process_group(process_group, None)
        self.device_mesh = None
        self._connect()

    # ---- comm hooks and timing -----------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the default averaging all-reduce: ``hook(state, bucket) -> Future[Tensor]``.

        The future's value must be the bucket's flat tensor averaged over ranks. Register once
        (a second call raises RuntimeError, as torch's). Hooks written for torch's DDP work
        unchanged. Register the same hook on every rank: it is not compared across ranks (that
        would take a collective here, where one rank may call alone), and a hook on some ranks
        only makes gloo abort the first backward.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        check_annotations(hook)
        if self._hook_registered:
            why = (" (mixed_precision installed its reduce_dtype hook)"
                   if self._reduce_dtype is not None else
                   " (reduce_dtype installed lockstep.comm.fp32_accumulate_hook)"
                   if self.reduce_dtype is not None else "")
            raise RuntimeError(
                f"register_comm_hook may be called only once per model{why}; build a new "
                "DistributedDataParallel to use another hook, or combine both in one hook."
            )
        self._hook_registered = True
        if self._reducer is None and self.world_size == 1 and self._trainable_names:
            # A world of one reduces nothing, but a hook may change the gradients (clipping,
            # compression's rounding, PowerSGD's error feedback): torch runs it there too.
            self._reducer = self._new_reducer()
            self._reducer.clock = self._clock  # a profile already on: the reducer marks it now
            if self._arrivals is not None:  # it stood in for the absent reducer's bucket marks
                self._arrivals.remove()
                self._arrivals = None
        if self._reducer is not None:
            self._reducer.comm_hook, self._reducer.comm_state = returns_future(hook), state


def _unique_trainable(module: nn.Module, ignored: Collection[str] = ()) -> list[tuple[str, nn.Parameter]]:
    # named_parameters() already yields a tied parameter once, under its first name.
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
