"""Copy a module onto several devices so that autograd sums every replica's gradient back.

The first replica is the module itself: it already lives on the first device, and its buffers
are the originals, so in-place buffer updates (BatchNorm running statistics) land in the module
from the first replica only, as with torch's DataParallel. Every other replica is a shallow copy
of each submodule whose parameters lie in one flat copy per dtype: the module's
parameters are concatenated once and that buffer is copied once per device, so a model of a
thousand tensors costs one copy per device, not a thousand (:mod:`lockstep.dp.broadcast`).
Backward through any replica sums its gradients into the original parameters' ``.grad``, sparse
ones staying sparse. Buffers that require grad take part in autograd the same way; the others
are copied without it. Slots registered as None (``bias=False``) stay None in the replicas.
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from lockstep._torch_compat import refresh_rnn_flat_weights, replica_of
from lockstep.dp.broadcast import broadcast_coalesced
from lockstep.dp.devices import DeviceLike, as_device

__all__ = [
    "attribute_snapshots",
    "check_module_device",
    "module_pairs",
    "refresh_attributes",
    "replicate",
]

M = TypeVar("M", bound=nn.Module)


def replicate(network: M, devices: Sequence[DeviceLike], detach: bool = False) -> list[M]:
    """One replica of ``network`` per device; the first is ``network`` itself.

    Args:
        network: the module, with all parameters and buffers on ``devices[0]``.
        devices: one device per replica (the same device may repeat, as with ``['cpu', 'cpu']``).
        detach: copy without recording autograd (inference); replicas then carry no gradient.

    Returns:
        The replicas, in device order.

    Raises:
        ValueError: a parameter or buffer of ``network`` is not on ``devices[0]``.

    Example:
        >>> a, b = replicate(nn.Linear(2, 2), ["cpu", "cpu"])
        >>> a.weight is not b.weight and torch.equal(a.weight, b.weight)
        True
    """
    devs = [as_device(d) for d in devices]
    if not devs:
        raise ValueError("replicate() needs at least one device")
    check_module_device(network, devs[0])
    if len(devs) == 1:
        return [network]
    modules = list(network.modules())
    params = [(m, name, t) for m in modules for name, t in m._parameters.items() if t is not None]
    buffers = [(m, name, t) for m in modules for name, t in m._buffers.items() if t is not None]
    # Tied tensors (one parameter in two modules) are copied once and stay tied in the replicas.
    unique_params = list({id(t): t for _, _, t in params}.values())
    unique_buffers = list({id(t): t for _, _, t in buffers}.values())
    param_copies = _copy_coalesced(unique_params, devs[1:], share_same_device=True, detach=detach)
    # Buffers are mutated in place by some forwards: every replica's copies lie in memory of
    # their own (broadcast_coalesced gives a second replica on one device its own flat copy).
    # Those that require grad stay in the graph, as torch's replicate keeps them.
    buffer_copies = _copy_coalesced(unique_buffers, devs[1:], share_same_device=True, detach=detach)
    replicas: list[M] = [network]
    for k in range(len(devs) - 1):
        clones = {id(m): _shallow_copy(m) for m in modules}
        for m in modules:
            clones[id(m)]._modules = OrderedDict(
                (name, None if child is None else clones[id(child)])
                for name, child in m._modules.items()
            )
        for m, name, param in params:
            # A plain tensor (not an nn.Parameter) with a grad_fn: assigned through the dict
            # because Module.__setattr__ only accepts Parameters in that slot.
            clones[id(m)]._parameters[name] = param_copies[id(param)][k]  # type: ignore[assignment]
        for m, name, buffer in buffers:
            clones[id(m)]._buffers[name] = buffer_copies[id(buffer)][k]
        for clone in clones.values():
            _refresh_cached_references(clone)
        replicas.append(clones[id(network)])  # type: ignore[arg-type]
    return replicas


def check_module_device(network: nn.Module, device: torch.device) -> None:
    """Raise ValueError naming the first parameter or buffer of ``network`` not on ``device``."""
    # Runs on every forward: compare devices first, and look names up only to report a culprit.
    if all(t.device == device for t in network.parameters()) and all(
        t.device == device for t in network.buffers()
    ):
        return
    named_tensors = (("parameter", network.named_parameters()), ("buffer", network.named_buffers()))
    for kind, named in named_tensors:
        for name, tensor in named:
            if not _same_device(tensor.device, device):
                raise ValueError(
                    f"{kind} {name!r} is on {tensor.device} but DataParallel needs the module on "
                    f"device_ids[0] = {device}; call module.to({str(device)!r}) before wrapping it"
                )


def _same_device(a: torch.device, b: torch.device) -> bool:
    # 'cuda' without an index means the current device; compare the resolved index.
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        a_index = a.index if a.index is not None else current
        return a_index == (b.index if b.index is not None else current)
    return a.index == b.index or a.type == "cpu"


_OWN = frozenset({"_parameters", "_buffers", "_modules"})
_MISSING = object()


def module_pairs(network: nn.Module, replica: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Each submodule of ``network`` with its copy in ``replica`` (made by :func:`replicate`)."""
    return list(zip(network.modules(), replica.modules()))


def refresh_attributes(
    pairs: Sequence[tuple[nn.Module, nn.Module]], seen: Sequence[dict[str, Any]]
) -> None:
    """Bring the plain attributes set on (or deleted from) each original of ``pairs``
    (:func:`module_pairs`) since ``seen`` (the originals' ``__dict__`` copies,
    :func:`attribute_snapshots`) to its replica, and update ``seen``.

    A replica kept between forwards (``lockstep.dp.replica_cache``) took a copy of each
    module's attributes when it was made; a temperature, an ``eps`` or a flag set since must
    reach it as they reach the module, and a deleted one must go (so the class default applies
    again; until 2026-11-29 it stayed). Comparing with what the original held, not with the
    replica, leaves alone what the replica made differently (a GraphModule's own code). Its own
    tensors and children stay.
    """
    for (original, clone), before in zip(pairs, seen):
        now = original.__dict__
        # Fast path, at C speed: the same values in the same places, as when nothing was set
        # since. A changed key set of the same size needs a key inserted since, and insertion
        # order puts it last: the last key stands for the keys at O(1).
        if len(now) == len(before) and next(reversed(now), None) == next(reversed(before), None) \
                and not any(map(operator.is_not, now.values(), before.values())):
            continue
        changed = [name for name, value in now.items()
                   if before.get(name, _MISSING) is not value and name not in _OWN]
        deleted = [name for name in before if name not in now and name not in _OWN]
        mine = clone.__dict__
        for name in changed:
            mine[name] = now[name]
        for name in deleted:
            mine.pop(name, None)
        before.clear()
        before.update(now)
        if changed or deleted:
            _refresh_cached_references(clone)


def attribute_snapshots(pairs: Sequence[tuple[nn.Module, nn.Module]]) -> list[dict[str, Any]]:
    """A copy of each original's ``__dict__``, for :func:`refresh_attributes`."""
    return [dict(original.__dict__) for original, _ in pairs]


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s attributes, hooks and class, with fresh slots.

    A class that overrides torch's replicate hook (``_replicate_for_data_parallel``) is copied
    through it, as torch's replicate does: ``torch.fx.GraphModule`` copies itself there, its
    class, made per instance, holding the generated forward that ``__new__`` alone would not
    (until 2026-11-29 a GraphModule could not be replicated, and such hooks were not called).
    """
    clone: nn.Module
    custom = replica_of(module)  # a class's own replicate hook (GraphModule's, a user's)
    if custom is not None:
        clone = custom
    elif isinstance(module, torch.fx.GraphModule):
        clone = copy.copy(module)
    else:  # what torch's default hook does, without the slot copies replaced below anyway
        clone = module.__new__(type(module))
        clone.__dict__ = module.__dict__.copy()
    # Slots registered as None (``bias=False``) stay, as None, in the original order: modules
    # read ``self.bias`` in forward. replicate() fills in the others.
    clone._parameters = OrderedDict.fromkeys(module._parameters)
    clone._buffers = OrderedDict.fromkeys(module._buffers)
    clone._modules = OrderedDict()
    return clone


def _refresh_cached_references(clone: nn.Module) -> None:
    """Point lists that a module keeps of its own parameters at the replica's copies.

    torch's RNNs (LSTM, GRU, RNN) run from ``_flat_weights``, a list of their parameters made at
    construction; the shallow copy would still share the original list of original tensors.
    """
    refresh_rnn_flat_weights(clone)


def _copy_coalesced(
    tensors: Sequence[torch.Tensor], devices: list[torch.device], *, share_same_device: bool, detach: bool
) -> dict[int, list[torch.Tensor]]:
    """Each tensor's copy on every device, made through one flat copy per group and device.

    Returns ``{id(tensor): [copy on devices[0], copy on devices[1], ...]}``. Tensors are grouped
    by dtype and by whether they require grad, so a frozen parameter stays frozen in replicas.
    """
    result: dict[int, list[torch.Tensor]] = {}
    groups: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.requires_grad and not detach), []).append(t)
    for (_, track), group in groups.items():
        with torch.set_grad_enabled(torch.is_grad_enabled() and track):
            copies = broadcast_coalesced(group, devices, share_same_device=share_same_device)
        for i, t in enumerate(group):
            result[id(t)] = [per_device[i] for per_device in copies]
    return result
