"""The one seam to torch's private internals: every private torch name lockstep uses is here.

Each function names one private piece of torch, says why lockstep needs it, and fails with
:class:`TorchCompatError` naming the installed torch version when that torch lacks it (a
rename would otherwise surface as an ``AttributeError`` deep in a backward pass). The rest of
lockstep reads as if it used only public torch; ``tests/test_layers.py`` fails when a private
torch name appears outside this module, and ``tests/test_torch_compat.py`` checks that each one
exists on the installed torch (lockstep supports torch >= ``OLDEST_TORCH``; run that test under
the oldest supported torch as well as the pinned one).

torch.compile's internals are in :mod:`lockstep._torch_compat_compile`, apart, because
marking their frames for Dynamo imports Dynamo (over a second), which a process that never
compiles should not pay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "OLDEST_TORCH",
    "BatchNormBase",
    "OptimizerStateDictHooks",
    "RendezvousInternals",
    "TorchCompatError",
    "WorkersStoreOverride",
    "copy_tensors",
    "current_graph_task_id",
    "ddp_ignored_names",
    "default_store",
    "flatten_dense_tensors",
    "forget_shared_store_server",
    "is_loader_iterator",
    "loader_batches_yielded",
    "loader_index_sampler",
    "optimizer_state_dict_hooks",
    "preserve_version_counter",
    "queue_callback",
    "refresh_rnn_flat_weights",
    "rendezvous_internals",
    "replica_of",
    "set_ddp_ignored_names",
    "tensor_version",
    "unflatten_dense_tensors",
]

OLDEST_TORCH = "2.4"  # pyproject.toml's `torch>=`; every name below exists there and on 2.13


class TorchCompatError(RuntimeError):
    """A private torch name lockstep relies on is missing from the installed torch."""


def _missing(what: str, why: str, err: Exception) -> TorchCompatError:
    return TorchCompatError(
        f"torch {torch.__version__} has no {what} (lockstep uses it to {why}): {err}. "
        f"lockstep supports torch >= {OLDEST_TORCH} up to the version it pins; install one of "
        "those, or report this torch version to lockstep."
    )


# ---- autograd engine ----------------------------------------------------------------------
def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (autograd's engine callback queue).

    Callbacks run in queue order once every gradient of the graph task is computed; one queued
    from a callback runs after all those queued before it. torch's own DDP and FSDP use it.
    """
    try:
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        queue = engine.queue_callback
    except AttributeError as err:
        raise _missing("Variable._execution_engine.queue_callback",
                       "act when a backward pass ends", err) from err
    queue(callback)


def current_graph_task_id() -> int:
    """An id of the graph task (backward pass) running on this thread; -1 outside backward."""
    try:
        task_id = torch._C._current_graph_task_id
    except AttributeError as err:
        raise _missing("torch._C._current_graph_task_id",
                       "tell one backward pass from the next", err) from err
    return int(task_id())


@contextlib.contextmanager
def preserve_version_counter(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Write into ``tensors`` in place without bumping their version counters (as torch's DDP
    does for buffers it broadcasts: a second forward must not invalidate what the first saved)."""
    try:
        preserve = torch.autograd._unsafe_preserve_version_counter
    except AttributeError as err:
        raise _missing("torch.autograd._unsafe_preserve_version_counter",
                       "broadcast buffers between two forwards", err) from err
    with preserve(tuple(tensors)):
        yield


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place writes autograd has counted on ``tensor`` (``tensor._version``).

    The checkpoint's deferred copy compares it before and after copying a parameter, to tell a
    consistent copy from one the loop wrote into meanwhile (issue #24). Writes through
    ``tensor.data`` or ``preserve_version_counter`` are not counted.
    """
    try:
        return int(tensor._version)
    except AttributeError as err:
        raise _missing("Tensor._version", "check that a checkpoint's copy of a tensor is "
                       "consistent", err) from err


def copy_tensors(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
                 non_blocking: bool = False) -> None:
    """``buffer.copy_(source, non_blocking)`` for each pair, in one call (``torch._foreach_copy_``).

    A checkpoint's snapshot copies a few hundred tensors per save on threads that share the GIL
    with training: one call instead of one per tensor (issue #24). Only where every tensor is
    on the CPU: between devices torch's foreach kernels take a per-tensor path of their own, not
    checked here without a GPU, so the loop (as before) is kept for them, and where torch has no
    ``_foreach_copy_``.
    """
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None or not all(t.is_cpu for t in (*buffers, *sources)):
        for buffer, source in zip(buffers, sources):
            buffer.copy_(source, non_blocking=non_blocking)
        return
    foreach(list(buffers), list(sources), non_blocking=non_blocking)


class OptimizerStateDictHooks(NamedTuple):
    """The hooks torch's public ``Optimizer.register_*state_dict*_hook`` methods registered."""

    save_pre: list[Callable[..., Any]]
    save_post: list[Callable[..., Any]]
    load_pre: list[Callable[..., Any]]
    load_post: list[Callable[..., Any]]


def optimizer_state_dict_hooks(optimizer: torch.optim.Optimizer) -> OptimizerStateDictHooks:
    """The state-dict hooks registered on ``optimizer``, in registration order.

    An optimizer that builds its own state dict (lockstep's ZeroRedundancyOptimizer gathers
    the shards) runs them where ``Optimizer.state_dict``/``load_state_dict`` would.
    """
    try:
        return OptimizerStateDictHooks(
            list(optimizer._optimizer_state_dict_pre_hooks.values()),
            list(optimizer._optimizer_state_dict_post_hooks.values()),
            list(optimizer._optimizer_load_state_dict_pre_hooks.values()),
            list(optimizer._optimizer_load_state_dict_post_hooks.values()),
        )
    except AttributeError as err:
        raise _missing("Optimizer._optimizer_*state_dict*_hooks",
                       "run an optimizer's state-dict hooks", err) from err


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` back to back (torch's coalesced broadcasts use it)."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor,
                            tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten_dense_tensors`)."""
    from torch._utils import _unflatten_dense_tensors

    return tuple(_unflatten_dense_tensors(flat, tensors))


# ---- modules ---------------------------------------------------------------------------
# The base class of torch's BatchNorm1d/2d/3d (and of its SyncBatchNorm): lockstep's
# SyncBatchNorm derives from it so that isinstance checks and state dicts match torch's.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase


# ---- module internals ------------------------------------------------------------------------------
def refresh_rnn_flat_weights(module: nn.Module) -> None:
    """Point an RNN's cached ``_flat_weights`` list at the module's current parameters.

    torch's RNNs (LSTM, GRU, RNN) run from a list of their parameters made at construction;
    a replica made by shallow copy would still use the original's tensors. No-op for others.
    """
    if not isinstance(module, nn.RNNBase):
        return
    try:
        names = module._flat_weights_names
    except AttributeError as err:
        raise _missing("nn.RNNBase._flat_weights_names", "replicate an RNN", err) from err
    module.__dict__["_flat_weights"] = [module._parameters.get(name) for name in names]


def replica_of(module: nn.Module) -> nn.Module | None:
    """A DataParallel replica of ``module`` made by its own class's replicate hook, or None.

    torch's ``replicate`` makes every replica through ``Module._replicate_for_data_parallel``;
    a class that overrides it (``torch.fx.GraphModule``, whose forward lives in a class made
    per instance; user modules with state of their own) needs its override called. None for a
    class that keeps torch's default (lockstep makes that copy itself) or a torch without it.
    """
    base = getattr(nn.Module, "_replicate_for_data_parallel", None)
    own = getattr(type(module), "_replicate_for_data_parallel", None)
    if base is None or own is None or own is base:
        return None
    return own(module)


# ---- process groups -----------------------------------------------------------------------
def default_store() -> Any:
    """The default process group's store, or None when no default group exists.

    torch keeps it privately; it is the one place every rank can read without joining a
    collective, which is what hang diagnosis needs.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        get = dist.distributed_c10d._get_default_store
    except AttributeError as err:
        raise _missing("torch.distributed.distributed_c10d._get_default_store",
                       "read other ranks' progress without a collective", err) from err
    return get()


# ---- elastic rendezvous -------------------------------------------------------------------
# lockstep's rendezvous (lockstep/launcher/rendezvous.py) subclasses torch's public
# DynamicRendezvousHandler and reads nothing private itself: what it needs of the handler's
# members is below. Recent torch has the agent host a store for its workers
# (``_create_tcp_store_server``, cached in ``_shared_tcp_store_server``/``_bootstrap_store_info``);
# a torch without it keeps nothing across rounds, so forgetting is a no-op there.
class RendezvousInternals(NamedTuple):
    """What lockstep's rendezvous handler reads of torch's ``DynamicRendezvousHandler``."""

    store: Any  # the rendezvous store
    settings: Any  # RendezvousSettings: run_id, keep_alive_interval…
    state: Any  # the last synced _RendezvousState: round, participants, wait_list…
    this_node: Any  # _NodeDesc of this launcher


def rendezvous_internals(handler: Any) -> RendezvousInternals:
    """The private members of a ``DynamicRendezvousHandler`` that reports need.

    ``_store``, ``_settings``, ``_state_holder.state`` (the state as last synced: no store
    round trip) and ``_this_node``; read afresh by each call.
    """
    try:
        return RendezvousInternals(handler._store, handler._settings,
                                   handler._state_holder.state, handler._this_node)
    except AttributeError as err:
        raise _missing("DynamicRendezvousHandler._store/_settings/_state_holder/_this_node",
                       "report who is in a rendezvous", err) from err


def _agent_hosts_workers_store() -> bool:
    """Whether this torch's rendezvous handler hosts its workers' store (and caches it)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    return hasattr(DynamicRendezvousHandler, "_create_tcp_store_server")


def forget_shared_store_server(handler: Any) -> None:
    """Make ``next_rendezvous`` build a fresh TCP store rather than reuse the last round's.

    Clears ``_shared_tcp_store_server`` and ``_bootstrap_store_info``. On a torch whose handler
    hosts no store for its workers (no ``_create_tcp_store_server``) there is nothing to forget.
    """
    if not _agent_hosts_workers_store():
        return
    if not hasattr(handler, "_shared_tcp_store_server"):
        raise _missing("DynamicRendezvousHandler._shared_tcp_store_server",
                       "start each rendezvous round on a fresh store",
                       AttributeError("_shared_tcp_store_server"))
    handler._shared_tcp_store_server = None
    handler._bootstrap_store_info = None


class WorkersStoreOverride:
    """Mixin for a ``DynamicRendezvousHandler`` subclass that hosts its workers' store itself.

    torch's handler makes that store (on rank 0, for the workers' ``init_process_group``) in its
    private ``_create_tcp_store_server``, listening on every interface; the only way to choose
    otherwise is to override that private method. The override lives here, so that the
    subclass defines the public-named :meth:`workers_store_server` instead. Put this class
    before the torch handler in the subclass's bases. On a torch that hosts no store for its
    workers, the override is never called (``tests/test_torch_compat.py`` checks it is on the
    installed torch).
    """

    def workers_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        """The store the workers meet on: a server at ``master_port`` (0: any free port)."""
        raise NotImplementedError

    def _create_tcp_store_server(self, *args: Any) -> dist.TCPStore:
        # torch 2.13 passes (master_addr, master_port); an earlier form of torch's code passed
        # one RendezvousStoreInfo (with master_addr and master_port) instead.
        if len(args) == 1:
            info = args[0]
            return self.workers_store_server(info.master_addr, info.master_port)
        master_addr, master_port = args
        return self.workers_store_server(master_addr, master_port)


# torch's DDP reads the names of the parameters and buffers it must leave alone from this
# attribute of the module it wraps, set by DistributedDataParallel._set_params_and_buffers_to_ignore_for_model.
_DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def set_ddp_ignored_names(module: nn.Module, names: Sequence[str]) -> None:
    """Record ``names`` (fully qualified, relative to ``module``) as torch's DDP does: on the
    module, and as ``_ddp_ignored`` on each named parameter and buffer."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"params_and_buffers_to_ignore must be a list of names such as ['head.weight'], got {names!r}")
    setattr(module, _DDP_IGNORE_ATTR, list(names))
    wanted = set(names)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in wanted:
            tensor._ddp_ignored = True  # type: ignore[attr-defined]  # torch's mark


def ddp_ignored_names(module: nn.Module) -> frozenset[str]:
    """The names torch's DDP would leave alone in ``module`` (none unless set as above, by
    lockstep's or torch's class)."""
    names = getattr(module, _DDP_IGNORE_ATTR, None) or ()
    return frozenset(n for n in names if isinstance(n, str))


# ---- a DataLoader iterator's position ---------------------------------------------------------
# A DataLoader with worker processes reads its sampler ahead of the training loop; how many
# batches the loop really received is the iterator's private count. lockstep's samplers read it
# so that a checkpoint mid-epoch resumes after the last batch trained on, not the last read.


def is_loader_iterator(obj: object) -> bool:
    """Whether ``obj`` is the iterator a ``DataLoader`` returns (``_BaseDataLoaderIter``)."""
    try:
        base = torch.utils.data.dataloader._BaseDataLoaderIter
    except AttributeError as err:
        raise _missing("torch.utils.data.dataloader._BaseDataLoaderIter",
                       "to find the DataLoader that reads a sampler", err) from err
    return isinstance(obj, base)


def loader_index_sampler(state: dict[str, Any]) -> Any:
    """What a DataLoader iterator (given as ``vars(iterator)``) draws indices from: its batch
    sampler, or its sampler when it does not batch (``batch_size=None``)."""
    try:
        return state["_index_sampler"]
    except KeyError as err:
        raise _missing("DataLoader iterator's _index_sampler",
                       "to tell how many samples a batch holds", err) from err


def loader_batches_yielded(state: dict[str, Any]) -> int:
    """How many batches a DataLoader iterator (given as ``vars(iterator)``) has handed out."""
    try:
        return int(state["_num_yielded"])
    except KeyError as err:
        raise _missing("DataLoader iterator's _num_yielded",
                       "to count the batches the training loop has received", err) from err
