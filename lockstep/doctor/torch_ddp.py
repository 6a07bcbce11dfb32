"""The doctor on scripts lockstep did not write: torch's own DistributedDataParallel, observed.

Hugging Face's Trainer, Lightning and Accelerate wrap the model in
:class:`torch.nn.parallel.DistributedDataParallel`. Under ``LOCKSTEP_PROFILE`` (set by
``lockstep doctor``) each worker calls :func:`observe_torch_ddp` before the script runs, and
every torch DDP the script builds is recorded by the same :class:`~lockstep.doctor.recorder.Recorder`
lockstep's own DDP uses, so the profile, the account, the findings and the pictures are the same.

Only public seams are used:

- discovery: a global module forward pre-hook (``register_module_forward_pre_hook``) notices
  each torch DDP instance at its first forward (no class is patched);
- forward: the instance's forward pre/post hooks; backward start: a gradient hook on the first
  output tensor; gradients ready: ``register_post_accumulate_grad_hook`` (see below);
- buckets: a comm hook (``register_comm_hook``) that launches the default all-reduce itself
  (one future callback per bucket stamps its completion), or wraps the hook the script
  registers afterwards (the instance's ``register_comm_hook`` is replaced, on that
  instance only, by one that chains behind the recorder). A hook registered *before* the first
  forward cannot be wrapped: the buckets are then not observed, and a warning says so;
- optimizer: torch's global optimizer step hooks (in the recorder).

One private name is used, in :func:`_after_backward`: the autograd engine's ``queue_callback``
(what torch's DDP itself uses to finish a backward), to mark the end of backward.

A world of one has no DDP (Trainer does not wrap a single process): there the first outermost
module called since the last optimizer step whose parameters that step updates (the model, not
a loss module such as ``nn.MSELoss()`` called after it) is recorded from its next forward on,
that step counting as the first (so a bounded run ends after ``--steps`` optimizer steps), and
:class:`~lockstep.ddp.arrivals.GradientArrivals` marks the buckets DDP would send.

Gradient hooks, and their cost: a Python hook on every parameter cost 10-20% of a GPU step
bound by the host's kernel launches, so, as :class:`~lockstep.ddp.arrivals.GradientArrivals`
does, every trainable parameter is hooked only during the first backward, which learns the order
gradients arrive in. From then on one hook is left, on the parameter that arrived last (it marks
the end of backward's compute), and the comm hook names each bucket's last gradient from that
order (worked out once per bucket, from ``bucket.parameters()``, and again if the layout
changes: torch's DDP rebuilds its buckets after the first synchronised backward). A world of
one keeps no hook of its own: with nothing to communicate, backward's compute ends when backward
does. This assumes what torch's reducer assumes when it rebuilds its buckets: the arrival order is
the same every backward. When it is not (a parameter that gets no gradient in a later backward,
a branch taken only sometimes), nothing fails and nothing waits: a bucket is named by the
gradient that came last in the first backward (None if none of its gradients came), and a
backward whose last watched gradient does not come has its compute end at its end.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from lockstep._torch_compat import queue_callback
from lockstep.ddp.arrivals import GradientArrivals
from lockstep.ddp.backward_end import hook_backward_start
from lockstep.doctor.profile_env import settings_from_env
from lockstep.doctor.recorder import Recorder

__all__ = ["DDPObserver", "TorchDDPWatch", "observe_torch_ddp"]

logger = logging.getLogger(__name__)

_TORCH_BUCKET_CAP = 25 * 2**20  # torch DDP's default bucket_cap_mb


def _after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward has finished, DDP's own finalisation included.

    The only private torch name here: the engine's ``queue_callback``. Callbacks run in queue
    order and one queued from a callback runs after all queued before it, so queuing twice puts
    this after the reducer's ``finalize_backward`` (queued when its last bucket became ready).
    """
    queue_callback(lambda: queue_callback(callback))


class DDPObserver:
    """Records one model: a torch DDP instance (``ddp`` True) or a plain module (world of one)."""

    def __init__(self, module: nn.Module, settings: dict[str, Any], steps_done: int = 0) -> None:
        from lockstep.ddp.profiling import _model_entry

        self.ddp = module if isinstance(module, TorchDDP) else None
        inner = module.module if isinstance(module, TorchDDP) else module
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        device = named[0][1].device if named else torch.device("cpu")
        group = None
        if self.ddp is not None and dist.get_world_size(self.ddp.process_group) > 1:
            group = self.ddp.process_group
        self._layout: dict[int, dict[str, Any]] = {}
        self._arrivals: GradientArrivals | None = None
        # A plain module (a script that wraps only at world >= 2, as Trainer-style loops do) is
        # listed with the broadcasts DDP's default (broadcast_buffers=True) would send, which is
        # what its world-1 profile is planned as.
        broadcast = (True if self.ddp is None
                     else bool(getattr(self.ddp, "broadcast_buffers", False)))
        self.recorder = Recorder(device, [p for _, p in named], group, self._bucket_layout,
                                 _model_entry(inner, list(inner.buffers()), broadcast),
                                 **settings, steps_done=steps_done)
        self.recorder.model_info["observed"] = ("torch.nn.parallel.DistributedDataParallel"
                                                if self.ddp is not None else type(inner).__name__)
        self._handles = [module.register_forward_pre_hook(self._forward_pre, with_kwargs=True),
                         module.register_forward_hook(self._forward_post)]
        self._in_forward = False  # inside the DDP instance's forward (its inner module's runs)
        if self.ddp is not None:
            # torch's DDP broadcasts the buffers inside its forward, before calling the inner
            # module: the inner module's start ends that wait (exposed_comm, not forward).
            self._handles.append(inner.register_forward_pre_hook(self._inner_started))
        # gradient arrivals (see the module docstring): every parameter is watched until the
        # first backward ends, then only the one that arrived last
        self._arrival: dict[int, int] = {}  # parameter -> its place in the first backward
        self._arrivals_seen = 0
        self._learned = False
        self._last_param: str | None = None  # the latest arrival, while learning
        self._synced_once = False  # torch's DDP rebuilds its buckets after the first one
        self._bucket_last: dict[int, tuple[int, str | None]] = {}  # index -> (bytes, last name)
        self._grad_handles: list[RemovableHandle] = []
        if self.ddp is None:
            self._arrivals = GradientArrivals(self._params, self._names, _TORCH_BUCKET_CAP,
                                              self.recorder)
        else:
            self._grad_handles = [p.register_post_accumulate_grad_hook(
                functools.partial(self._grad_arrived, i)) for i, p in enumerate(self._params)]
        self.buckets_observed = self.ddp is not None and self._wrap_comm_hook(self.ddp)

    def watched(self) -> int:
        """How many parameters run a gradient hook each backward (GradientArrivals' included).

        Every trainable parameter until the first backward ends; then 1 under torch's DDP, and
        one per bucket in a world of one (GradientArrivals', none of the observer's own).
        """
        own = len(self._grad_handles)
        return own + (self._arrivals.watched() if self._arrivals is not None else 0)

    # ---- comm hook -------------------------------------------------------------------------
    def _wrap_comm_hook(self, ddp: TorchDDP) -> bool:
        # None: torch's default all-reduce, which the recorder's own hook launches (see
        # _comm_hook); otherwise the script's hook and its state, chained behind the recorder.
        self._inner: Callable[[Any, Any], torch.futures.Future] | None = None
        self._inner_state: Any = None
        self._group = ddp.process_group
        self._world = dist.get_world_size(ddp.process_group)
        try:
            # unannotated: torch checks annotations, which are strings in this module
            ddp.register_comm_hook(None, lambda state, bucket: self._comm_hook(state, bucket))
        except RuntimeError as err:  # the script registered its own hook before the first forward
            logger.warning("lockstep doctor: %s: the script registered its own comm hook before "
                           "the first forward, so per-bucket all-reduce times are not observed "
                           "(forward, backward and optimizer still are). Register it after the "
                           "first forward, or call model.register_comm_hook later, to see them. "
                           "(%s)", type(ddp.module).__name__, err)
            return False

        def chained(state: object, hook: Callable[..., Any]) -> None:
            self._inner, self._inner_state = hook, state  # the recorder stays in front

        ddp.register_comm_hook = chained  # type: ignore[method-assign]  # this instance only
        return True

    def _comm_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        index, rec = bucket.index(), self.recorder
        rec.backward_started()
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        known = self._bucket_last.get(index)
        if known is None or known[0] != nbytes:  # not named yet, or the layout has changed
            known = (nbytes, self._new_bucket(bucket, nbytes))
        rec.bucket_ready(index, known[1])
        if self._inner is not None:  # the script's hook: stamp the future it returns
            rec.bucket_launched(index)
            future = self._inner(self._inner_state, bucket)
            rec.watch_bucket(index, future)
            return future
        # torch's default, as default_hooks.allreduce_hook does it (divide first, to avoid
        # overflow, then sum: the same bits as the reducer's built-in all-reduce), launched
        # here so that one callback both stamps the completion and hands DDP the tensor
        # (wrapping allreduce_hook chains two; issue #28).
        buffer.div_(self._world)
        rec.bucket_launched(index)
        work = dist.all_reduce(buffer, group=self._group, async_op=True)
        done = rec.bucket_done

        def completed(fut: torch.futures.Future) -> torch.Tensor:
            done(index)
            return fut.value()[0]

        return work.get_future().then(completed)

    def _new_bucket(self, bucket: dist.GradBucket, nbytes: int) -> str | None:
        """List the bucket in the layout; return its last gradient's name (cached when final)."""
        index, params = bucket.index(), [self._index.get(id(p)) for p in bucket.parameters()]
        self._layout[index] = {"index": index, "bytes": nbytes,
                               "params": [self._names[i] if i is not None else "?" for i in params]}
        if not self._learned:
            return self._last_param  # the first backward: the latest gradient is the last
        arrived = [i for i in params if i is not None and i in self._arrival]
        name = self._names[max(arrived, key=self._arrival.__getitem__)] if arrived else None
        if self._synced_once:  # torch's DDP has rebuilt its buckets (if it ever will)
            self._bucket_last[index] = (nbytes, name)
        return name

    def _bucket_layout(self) -> list[dict[str, Any]]:
        if self._arrivals is not None:
            return self._arrivals.layout()
        return [self._layout[i] for i in sorted(self._layout)]

    # ---- forward and backward ----------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, inputs: Any, kwargs: Any = None) -> None:
        if torch.is_grad_enabled():
            self.recorder.forward_started((inputs, kwargs or {}))
            self._in_forward = True

    def _inner_started(self, module: nn.Module, inputs: Any) -> None:
        if self._in_forward:
            self._in_forward = False
            self.recorder.forward_synced()

    def _forward_post(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._in_forward = False
        if not torch.is_grad_enabled():
            return
        self.recorder.forward_ended()
        hook_backward_start(output, self._backward_started)

    def _backward_started(self) -> None:
        self.recorder.backward_started()
        synced = self.ddp is None or bool(self.ddp.require_backward_grad_sync)
        _after_backward(lambda: self._backward_ended(synced))

    def _grad_arrived(self, index: int, _param: torch.Tensor) -> None:
        """The first backward (every parameter watched): learn the order."""
        self._arrivals_seen += 1
        self._arrival[index] = self._arrivals_seen  # a later arrival wins
        self._last_param = self._names[index]
        if len(self._arrival) == len(self._params):
            self.recorder.backward_compute_ended()

    def _last_arrived(self, _param: torch.Tensor) -> None:
        self.recorder.backward_compute_ended()

    def _learn_order(self) -> None:
        """After the first backward: keep one hook, on the parameter that arrived last."""
        self._learned = True
        for handle in self._grad_handles:
            handle.remove()
        last = max(self._arrival, key=self._arrival.__getitem__)
        self._grad_handles = [self._params[last].register_post_accumulate_grad_hook(
            self._last_arrived)]
        self._last_param = None

    def _backward_ended(self, synced: bool) -> None:
        rec = self.recorder
        rec.buckets_waited()
        if self.ddp is None:  # nothing to communicate: the compute ended with backward
            rec.backward_compute_ended()
        rec.backward_ended(synced=synced)
        rec.restart_optimizer_span()  # optimizer.step(closure), as Lightning calls it
        if self.ddp is not None and not self._learned and self._arrival:
            self._learn_order()
        self._synced_once = self._synced_once or synced

    def close(self) -> None:
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles, self._grad_handles = [], []
        if self._arrivals is not None:
            self._arrivals.remove()
        self.recorder.close()


_COMPILE_GLOBAL_HOOKS = r"Using `torch.compile\(module\)` when there are global hooks"


class TorchDDPWatch:
    """Finds the models to record (see the module docstring); :meth:`close` removes every hook."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.observers: list[DDPObserver] = []
        self._warned_second = False  # a second torch DDP was named once (see _module_pre)
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._depth = 0
        # world of one: the top-level modules called since the last optimizer step, in order
        # (the model, then a loss module such as nn.MSELoss: the first the optimizer updates wins)
        self._roots: list[weakref.ref[nn.Module]] = []
        self._single: weakref.ref[nn.Module] | None = None  # world of one: record this next
        self._handles = [register_module_forward_pre_hook(self._module_pre),
                         register_module_forward_hook(self._module_post),
                         register_optimizer_step_pre_hook(self._optimizer_pre)]
        # torch.compile warns at every call of a compiled module while global hooks exist:
        # these are the doctor's own (the script has none of them), so the warning, 21 lines
        # in an outside audit's run, says nothing about the script. The doctor's process runs
        # one script, so the filter stays for its life.
        warnings.filterwarnings("ignore", message=_COMPILE_GLOBAL_HOOKS, category=UserWarning)
        # Registered now, before the script runs: atexit runs the last registered first, so
        # every handler the script registers (loggers, wandb, lock files) runs before this one,
        # which may end the process with os._exit (see _at_exit). Registered at the first
        # forward (until 2026-11-29), it skipped the handlers the script registered before.
        atexit.register(self._at_exit)

    def _module_pre(self, module: nn.Module, inputs: Any) -> None:
        if self._depth == 0 and not any(ref() is module for ref in self._roots):
            self._roots.append(weakref.ref(module))
        self._depth += 1
        if module in self._seen:
            return
        single = self._single() if self._single is not None else None
        if isinstance(module, TorchDDP) or module is single:
            self._seen.add(module)
            self._single = None
            if isinstance(module, TorchDDP) and any(o.ddp is not None for o in self.observers):
                # One profile per worker: a second model (a GAN's discriminator) would overwrite
                # the first's rank file. Its forward, backward and all-reduce count as "other".
                if not self._warned_second:
                    self._warned_second = True
                    logger.warning(
                        "lockstep doctor: this worker runs a second torch DistributedDataParallel "
                        "(%s, %s parameters); only the first one it ran is profiled, and the "
                        "others' time counts as 'other'", type(module.module).__name__,
                        f"{sum(p.numel() for p in module.parameters()):,}")
                return
            # a model found at its first optimizer step (world of one): that step counts, so a
            # bounded run ends after --steps optimizer steps, as it does under DDP
            observer = DDPObserver(module, self.settings, steps_done=1 if module is single else 0)
            self.observers.append(observer)
            observer._forward_pre(module, inputs)  # its own pre-hook starts with the next call

    def _module_post(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        roots, self._roots = [ref() for ref in self._roots], []
        if self.observers or self._single is not None:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            return  # a larger world records its DDP; nothing else is guessed
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for root in roots:  # the first one this optimizer updates (not a loss module after it)
            if root is None or root in self._seen or not any(
                    id(p) in ids for p in root.parameters()):
                continue
            if getattr(root, "profiler", None) is None:  # not lockstep's DDP (records itself)
                self._single = weakref.ref(root)  # recorded from its next forward
            return

    def stop_discovery(self) -> None:
        """Record the models found so far, and no new ones (removes the global hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _at_exit(self) -> None:
        """Save, and end a bounded run (``lockstep doctor``) without interpreter teardown.

        The doctor ends the script mid-training (SystemExit from the optimizer hook); torch's
        DDP and gloo then sometimes abort while the interpreter shuts down ("terminate called
        without an active exception"), failing a run whose profile is already written. After
        the profile is saved such a process ends here, with status 0. This handler was
        registered before the script ran, so the script's own atexit handlers have run by now.
        Nothing is done without a torch DDP to observe (lockstep's DDP and plain models exit
        as usual).
        """
        if not any(observer.ddp is not None for observer in self.observers):
            return
        over = False
        for observer in self.observers:
            rec = observer.recorder
            rec.save()
            over = over or (rec.max_steps is not None and rec.step_count >= rec.max_steps)
        if over:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        self.stop_discovery()
        atexit.unregister(self._at_exit)
        for observer in self.observers:
            observer.close()


def observe_torch_ddp(environ: dict[str, str] | None = None) -> TorchDDPWatch | None:
    """Under ``LOCKSTEP_PROFILE``: record every torch DDP this process builds (None when off)."""
    settings = settings_from_env(environ)
    if settings is None:
        return None
    return TorchDDPWatch(settings)
