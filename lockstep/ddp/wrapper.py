"""lockstep.DistributedDataParallel: one process per device, gradients averaged during backward.

The wrapper owns the user-facing contract (torch's constructor, ``.module``, ``no_sync``,
``register_comm_hook``, state dicts without ``module.``); bucketing lives in ``bucket.py``, the
reduction in ``reducer.py``, start-up agreement in ``replica_sync.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lockstep import hang
from lockstep.ddp.bucket import MB
from lockstep.ddp.join import UnevenInputs
from lockstep.ddp.reducer import Reducer
from lockstep.ddp.replica_sync import broadcast_coalesced, verify_same_parameters
from lockstep.ddp.timing import StepClock, StepTiming

__all__ = ["DistributedDataParallel"]

_PREFIX = "module."


class DistributedDataParallel(nn.Module):
    """Data parallelism across processes: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    Every rank holds a replica; parameters and buffers are broadcast from rank 0 once, and the
    gradients of each backward pass are averaged over ranks by bucketed asynchronous all-reduces
    that overlap the rest of backward. In a world of one it communicates nothing.

    Args:
        module: the model, already on this rank's device.
        device_ids: ``[device]`` for a single-device CUDA module (inputs are moved there), or None.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (single-device modules don't scatter).
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) before each forward.
        process_group: the group to average over; None means the default group.
        bucket_cap_mb: bucket size in MB (the first bucket is 1 MB so reduction starts early).
        find_unused_parameters: tolerate parameters that receive no gradient in an iteration.
        gradient_as_bucket_view: ``.grad`` tensors are views of the bucket buffers (default True:
            no second copy of gradient memory).
        static_graph: accepted; the graph is treated like one with possibly unused parameters.

    Raises:
        ValueError: ranks hold different parameters (the message names rank and parameter).
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
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call lockstep.init_distributed() "
                "first (it works under lockstep run, torchrun, srun and plain python)."
            )
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters or static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._clock: StepClock | None = None
        self._uneven: UnevenInputs | None = None
        named = _unique_trainable(module)
        if not named:
            raise RuntimeError(
                "DistributedDataParallel: the module has no parameter with requires_grad=True; "
                "there is nothing to synchronise. Wrap a trainable model."
            )
        self._device = named[0][1].device
        self._check_devices(named)
        self._buffers_to_sync = [b for b in module.buffers()]
        self._reducer: Reducer | None = None
        self._src = dist.get_global_rank(self.process_group, 0)  # rank 0 of the group, globally
        if self.world_size > 1:
            verify_same_parameters(list(module.named_parameters()), self.process_group)
            state = [p.data for p in module.parameters()] + self._buffers_to_sync
            broadcast_coalesced(state, self._src, self.process_group)
            cap = int((bucket_cap_mb if bucket_cap_mb is not None else 25) * MB)
            self._reducer = Reducer(
                [p for _, p in named], [n for n, _ in named], self.process_group, cap,
                self.find_unused_parameters, gradient_as_bucket_view,
            )

    def _check_devices(self, named: list[tuple[str, nn.Parameter]]) -> None:
        for name, p in named:
            if p.device != self._device:
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} is on {p.device} but "
                    f"{named[0][0]!r} is on {self._device}; lockstep's DDP drives one device per "
                    "process. Move the whole model with model.to(device) before wrapping."
                )
        backend = str(dist.get_backend(self.process_group))
        if backend == "nccl" and self._device.type != "cuda":
            raise ValueError(
                f"DistributedDataParallel: the model is on {self._device} but the process group "
                "uses NCCL, which needs CUDA tensors. Call model.to(info.device) before wrapping."
            )
        if self.device_ids and len(self.device_ids) != 1:
            raise ValueError(
                f"device_ids={self.device_ids}: lockstep's DDP drives one device per process; "
                "pass device_ids=[local_rank] (or None) and start one process per device."
            )

    # ---- forward -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        reducer, clock = self._reducer, self._clock
        if reducer is None and clock is None and self.device_ids is None and self._uneven is None:
            return self.module(*inputs, **kwargs)
        if clock is not None:
            clock.forward_started()
        if self.device_ids is not None:
            device = torch.device("cuda", self.device_ids[0]) if isinstance(
                self.device_ids[0], int) else torch.device(self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        grad_enabled = torch.is_grad_enabled()
        src = self._src
        if self._uneven is not None:
            src = self._uneven.announce(grad_enabled and self.require_backward_grad_sync)
        self._sync_buffers(src)
        output = self.module(*inputs, **kwargs)
        if reducer is not None and grad_enabled:
            reducer.prepare_for_backward(self.require_backward_grad_sync)
        if clock is not None:
            clock.forward_ended()
            if grad_enabled:
                ends_itself = reducer is None or not self.require_backward_grad_sync
                _hook_first_tensor(output, clock, end_on_backward=ends_itself)
        return output

    def _sync_buffers(self, src: int) -> None:
        """Broadcast buffers from global rank ``src`` (rank 0, or an active rank under join)."""
        if self._reducer is not None and self.broadcast_buffers and self._buffers_to_sync:
            hang.run(self._reducer.progress, "DDP buffer broadcast",
                     lambda: broadcast_coalesced(self._buffers_to_sync, src, self.process_group))

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Train on uneven inputs: a rank that runs out of batches shadows the others.

        Wrap the whole training loop. At the end every rank holds the model of the rank that ran
        the most iterations. Costs one tiny all-reduce per forward while enabled.

        Args:
            divide_by_initial_world_size: average over all ranks (True), or over the ranks that
                still have inputs in each iteration (False).
            enable: turn the context off without changing code.
            throw_on_early_termination: instead, raise on every rank as soon as one runs out.

        Example::

            with model.join():
                for x, y in loader:          # loaders of different lengths per rank
                    ...
        """
        if not enable or self._reducer is None:
            yield
            return
        state = UnevenInputs(self, divide_by_initial_world_size, throw_on_early_termination)
        self._uneven = state
        try:
            yield
            self._uneven = None  # this rank's own forwards are over: now it only shadows
            state.shadow_until_all_joined()
        finally:
            self._uneven = None
            self._reducer.grad_scale = 1.0

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

    # ---- comm hooks and timing -----------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the default averaging all-reduce: ``hook(state, bucket) -> Future[Tensor]``.

        The future's value must be the bucket's flat tensor averaged over ranks. Register once,
        before the first backward. Hooks written for torch's DDP work unchanged.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if getattr(self, "_hook_registered", False):
            raise RuntimeError("register_comm_hook may be called only once per model")
        self._hook_registered = True
        if self._reducer is not None:
            self._reducer.comm_hook, self._reducer.comm_state = hook, state

    def enable_step_timing(self, enabled: bool = True) -> None:
        """Record forward, backward and exposed-communication seconds of every iteration."""
        self._clock = StepClock(self._device) if enabled else None
        if self._reducer is not None:
            self._reducer.clock = self._clock

    @property
    def step_timings(self) -> list[StepTiming]:
        """One :class:`~lockstep.ddp.timing.StepTiming` per iteration since timing was enabled."""
        return self._clock.history if self._clock is not None else []

    # ---- checkpoints: keys without "module." ----------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load keys with or without torch DDP's ``module.`` prefix.

        Raises:
            ValueError: ``assign=True`` with several ranks (it would replace the parameters
                whose gradients are being averaged).
        """
        if assign and self._reducer is not None:
            raise ValueError(
                "DistributedDataParallel.load_state_dict(assign=True) would replace the "
                "parameters lockstep averages; load with assign=False (the default), or load "
                "into the module before wrapping it."
            )
        if state_dict and all(k.startswith(_PREFIX) for k in state_dict):
            state_dict = {k[len(_PREFIX):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _unique_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    # named_parameters() already yields a tied parameter once, under its first name.
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move_to(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj


def _hook_first_tensor(output: Any, clock: StepClock, end_on_backward: bool) -> None:
    """Mark the start of backward when the gradient of the first output tensor is computed.

    Without a reducer (a world of one) nothing else marks the end of backward, so the hook
    also queues that on the autograd engine.
    """

    def started(grad: torch.Tensor) -> None:
        clock.backward_started()
        if end_on_backward:
            Variable._execution_engine.queue_callback(clock.backward_ended)

    stack = [output]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                obj.register_hook(started)
                return
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        elif isinstance(obj, dict):
            stack.extend(reversed(list(obj.values())))
