"""``fully_shard`` and the functions that act on a fully sharded model as a whole."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn

from lockstep.env import default_backend, detect_process_info
from lockstep.fsdp import collectives
from lockstep.fsdp.flat_param import FlatShard
from lockstep.fsdp.methods import attach_torch_methods
from lockstep.fsdp.mixed_precision import MixedPrecisionPolicy, as_policy
from lockstep.fsdp.registry import mark_replaced, owner_of, replaced_by
from lockstep.fsdp.unit import FSDPUnit, get_unit

__all__ = [
    "UnshardHandle",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "mesh_groups",
    "no_sync",
    "reshard",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "unshard",
]

Group = Union[dist.ProcessGroup, "dist.DeviceMesh", tuple, None]


def mesh_groups(group: Group) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group) that ``fully_shard(group=...)`` shards and replicates over."""
    return _groups(group)


def _groups(group: Group) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group) from a group, a DeviceMesh or a (replicate, shard) pair."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group, None
    if isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError(f"fully_shard: group=(replicate_group, shard_group) expected, got {len(group)} groups")
        replicate, shard = group
    elif hasattr(group, "get_group") and hasattr(group, "ndim"):
        if group.ndim == 1:
            return group.get_group(), None
        if group.ndim != 2:
            raise ValueError(f"fully_shard: a DeviceMesh of 1 or 2 dimensions expected, got {group.ndim}")
        replicate, shard = group.get_group(0), group.get_group(1)
    else:
        raise TypeError(f"fully_shard: group must be a ProcessGroup, DeviceMesh or pair, got {type(group).__name__}")
    sizes = (dist.get_world_size(replicate), dist.get_world_size(shard))
    if sizes[0] * sizes[1] != dist.get_world_size():
        raise ValueError(
            f"fully_shard: replicate group of {sizes[0]} × shard group of {sizes[1]} ranks does not "
            f"cover the world of {dist.get_world_size()}; build both from one layout (a 2-D DeviceMesh)"
        )
    return shard, replicate


def _collect(module: nn.Module) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """The parameters ``module`` manages: its own, minus those of nested units; ties merged."""
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, param in mod._parameters.items():
            if param is None:
                continue
            entry = found.setdefault(id(param), (prefix + name, param, []))
            entry[2].append((mod, name))
        for name, child in mod.named_children():
            if get_unit(child) is None:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return list(found.values())


def _nested_units(module: nn.Module) -> list[tuple[str, FSDPUnit]]:
    return [(n or "<root>", u) for n, m in module.named_modules() if (u := get_unit(m)) is not None]


def _check(module: nn.Module, params: list[tuple[str, nn.Parameter, list]]) -> None:
    name = type(module).__name__
    if get_unit(module) is not None:
        raise ValueError(f"fully_shard: {name} is already fully sharded; apply fully_shard once per module")
    nested = _nested_units(module)
    for where, unit in nested:
        if unit.root is not None:
            raise RuntimeError(
                f"fully_shard: the sharded submodule '{where}' already ran forward as its own root; "
                "call fully_shard on every block and then on the root before the first forward"
            )
    for fqn, param, _ in params:
        if owner_of(param) is not None:
            raise ValueError(
                f"fully_shard: {name}'s parameter '{fqn}' is already a shard of a module "
                "sharded earlier (a parent, or a module sharing it); apply fully_shard "
                "bottom-up, every block first and then the root, and shard a parameter shared "
                "by two modules with their common parent"
            )
        for where, unit in nested:
            if unit.flat.replaced(param):
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' is shared with the sharded submodule '{where}'; "
                    "a parameter can belong to one unit only: shard the module that holds both uses"
                )
        earlier = replaced_by(param)
        if earlier is not None:
            raise ValueError(
                f"fully_shard: {name}'s parameter '{fqn}' is shared with "
                f"{type(earlier.module).__name__}, sharded earlier (a tied weight); a parameter "
                "can belong to one unit only: shard the module that holds both uses, not each "
                "of them"
            )
    for i, (where_a, a) in enumerate(nested):
        for where_b, b in nested[i + 1 :]:
            overlap = [p for p in a.flat.originals() if b.flat.replaced(p)]
            if overlap:
                raise ValueError(
                    f"fully_shard: sharded submodules '{where_a}' and '{where_b}' share a parameter; "
                    "a parameter can belong to one unit only: shard their common parent instead"
                )
    devices = {p.device for _, p, _ in params}
    if len(devices) > 1:
        where = ", ".join(f"'{fqn}' on {p.device}" for fqn, p, _ in params)
        raise ValueError(f"fully_shard: {name}'s parameters live on different devices ({where}); move them to one device first")
    dtypes = {p.dtype for _, p, _ in params}
    if len(dtypes) > 1:
        where = ", ".join(f"'{fqn}' {p.dtype}" for fqn, p, _ in params)
        raise ValueError(f"fully_shard: {name}'s parameters have different dtypes ({where}); give a unit one dtype")


def fully_shard(
    module: nn.Module,
    *,
    group: Group = None,
    mesh: Group = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: Any = None,
    ignored_params: Any = None,
    shard_placement_fn: Any = None,
) -> nn.Module:
    """Shard ``module``'s parameters across ``group``: each rank keeps 1/N of each, flat and padded.

    Apply it to each block first, then to the root (a parameter belongs to the innermost sharded
    module that holds it). The module's parameters become 1-D shards (same names), which a plain
    torch optimizer over ``model.parameters()`` trains; forward and backward gather them.

    Args:
        module: the block or the root model; call it on every rank with identical parameters.
        group: where to shard: ``None`` (every rank), a ProcessGroup, a 2-D DeviceMesh
            (replicate, shard) or a pair ``(replicate_group, shard_group)`` for hybrid sharding.
        mesh: torch's name for it (a DeviceMesh), for scripts written for torch's fully_shard;
            give one of ``group`` and ``mesh``.
        reshard_after_forward: free the gathered parameters after forward (gather again for
            backward); ``False`` keeps them until the end of backward (less traffic, more memory).
            ``None`` (the default, as torch's): ``False`` for the root (whose parameters
            backward needs first), ``True`` for the others. An int as torch's: ``1`` is
            ``False``; a factor of the group's size is ``True`` (torch reshards to groups of
            that many ranks; here to the whole group).
        mp_policy: the :class:`MixedPrecisionPolicy` (default: compute in the parameters'
            dtype); torch's own ``MixedPrecisionPolicy`` is taken too.
        offload_policy, ignored_params, shard_placement_fn: torch's; only their defaults (no
            offloading, no ignored parameter, dim-0 shards) are supported.

    Returns:
        ``module`` itself.

    Raises:
        NotImplementedError: a list of modules (torch's one-group form).
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a container without forward (``nn.ModuleList``), already sharded, a parameter shared with another unit, parameters on
            different devices or of different dtypes, a hybrid layout that does not fit the world,
            an int ``reshard_after_forward`` that does not divide the group's size.
        RuntimeError: a sharded submodule already ran forward before the root was sharded; no
            process group in a process SLURM started as one of several (under ``torchrun`` or
            ``lockstep run`` the default group is made here from the environment, as torch does).
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError(
            f"fully_shard got a {type(module).__name__} of {len(module)} modules: torch's form "
            "that shards several modules as one group is not supported; call fully_shard on "
            "each of them (one gather each), or on a module whose forward calls them all"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__}; shard each block inside it, then the model that calls them"
        )
    if mesh is not None:
        if group is not None:
            raise ValueError("fully_shard: give group= or torch's mesh=, not both")
        group = mesh
    _refuse_unsupported(offload_policy, ignored_params, shard_placement_fn)
    policy = as_policy(mp_policy)
    params = _collect(module)
    _check(module, params)
    if not dist.is_initialized():
        _init_from_launch(params[0][1].device if params else torch.device("cpu"))
    shard_group, replicate_group = _groups(group)
    initialized = dist.is_initialized()
    rank = dist.get_rank(shard_group) if initialized else 0
    size = dist.get_world_size(shard_group) if initialized else 1
    after_forward = _reshard_flag(reshard_after_forward, size)
    own = params[0][1].dtype if params else torch.get_default_dtype()
    flat = FlatShard(params, rank, size, policy.compute_dtype(own))
    unit = FSDPUnit(module, flat, shard_group, replicate_group, after_forward, policy)
    for _, original, _ in params:
        mark_replaced(original, unit)
    attach_torch_methods(module, {  # torch's FSDPModule methods, for scripts written for it
        "unshard": unshard, "reshard": reshard, "set_requires_gradient_sync": set_requires_gradient_sync,
        "set_reshard_after_backward": set_reshard_after_backward,
        "set_reshard_after_forward": set_reshard_after_forward,
    })
    return module


def _init_from_launch(device: torch.device) -> None:
    """A process started as one of several (``WORLD_SIZE`` > 1) without a process group yet:
    make the default one from the launcher's environment, as torch's ``fully_shard`` does
    (sharding as a world of one would leave each rank with a model of its own)."""
    try:
        info = detect_process_info()
    except ValueError:
        return  # no launcher's environment to build a group from: a world of one
    if info.world_size == 1:
        return
    if info.source != "torchrun":  # torch's env:// needs RANK and WORLD_SIZE
        raise RuntimeError(
            f"fully_shard: this process is rank {info.rank} of {info.world_size} ({info.source}) "
            "but no process group exists; call lockstep.init_distributed() (or "
            "torch.distributed.init_process_group) before fully_shard"
        )
    dist.init_process_group(backend=default_backend(device))


def _refuse_unsupported(offload_policy: Any, ignored_params: Any, shard_placement_fn: Any) -> None:
    """torch's arguments that lockstep takes at their defaults only."""
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"fully_shard: offload_policy={type(offload_policy).__name__}(...) is not supported: "
            "lockstep keeps shards, gradients and optimizer state on the parameters' device. "
            "Leave offload_policy out (torch's default OffloadPolicy() is accepted)"
        )
    if ignored_params:
        raise NotImplementedError(
            f"fully_shard: ignored_params ({len(ignored_params)} parameters) is not supported; move "
            "those parameters into a module that is not sharded, or leave them in the unit"
        )
    if shard_placement_fn is not None:
        raise NotImplementedError(
            "fully_shard: shard_placement_fn is not supported: lockstep shards each parameter "
            "flat, in 1/N pieces (torch's default, dim 0, gives the same state dicts)"
        )


def _reshard_flag(value: bool | int | None, size: int) -> bool | None:
    """``reshard_after_forward`` as a flag; an int as torch reads it (1: keep the gathered
    parameters; a factor of the shard group's size: reshard, here to the whole group); ``None``
    stays ``None``: decided at the first forward (``False`` for the root, ``True`` below it)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"fully_shard: reshard_after_forward must be a bool or an int, got {value!r}")  # noqa: TRY004 (as torch)
    if value < 1 or size % value:
        raise ValueError(
            f"fully_shard: reshard_after_forward={value} as an int must be a factor of the shard "
            f"group's {size} ranks (1: keep the parameters gathered after forward, {size}: "
            "reshard); pass True or False"
        )
    return value > 1


def _units(module: nn.Module) -> list[FSDPUnit]:
    units = [u for _, u in _nested_units(module)]
    if not units:
        raise ValueError(f"{type(module).__name__} has no fully sharded module; call lockstep.fully_shard first")
    return units


def _own_unit(module: nn.Module, what: str) -> FSDPUnit:
    unit = get_unit(module)
    if unit is None:
        raise ValueError(
            f"{what}: {type(module).__name__} is not fully sharded; call lockstep.fully_shard on it first"
        )
    return unit


def _selected(module: nn.Module, recurse: bool, what: str) -> list[FSDPUnit]:
    return _units(module) if recurse else [_own_unit(module, what)]


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """Turn gradient reduction on or off for every sharded unit in ``module`` (torch's name).

    Off: each backward accumulates the full, unreduced gradients locally (memory of the whole
    unsharded gradient); the next backward with sync on reduces the sum once. ``recurse=False``
    sets ``module``'s own unit only, as torch's ``FSDPModule.set_requires_gradient_sync``.
    """
    for unit in _selected(module, recurse, "set_requires_gradient_sync"):
        unit.requires_gradient_sync = requires_gradient_sync


def set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool, *, recurse: bool = True) -> None:
    """Free the gathered parameters after backward (the default) or keep them (torch's name).

    ``False`` keeps each unit gathered after its backward, so the next forward needs no
    all-gather: for gradient accumulation, with :func:`set_requires_gradient_sync`. The kept
    parameters are the values from before the optimizer step: set it back to ``True`` before
    the last micro-batch's backward (or call :func:`reshard`) so the step's update is gathered.
    """
    for unit in _selected(module, recurse, "set_reshard_after_backward"):
        unit.reshard_after_backward = bool(reshard_after_backward)


def set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool, *, recurse: bool = True) -> None:
    """Change ``fully_shard``'s ``reshard_after_forward`` of the units under ``module`` (torch's name)."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"set_reshard_after_forward: expected True or False, got {reshard_after_forward!r}")
    for unit in _selected(module, recurse, "set_reshard_after_forward"):
        unit.reshard_after_forward = reshard_after_forward


class UnshardHandle:
    """What ``unshard(module, async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit: FSDPUnit | None = unit

    def wait(self) -> None:
        """Wait for the all-gather and register the full parameters on the module (once)."""
        if self._unit is not None:
            self._unit.unshard()
            self._unit = None


def unshard(module: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """All-gather ``module``'s own parameters and register the full tensors on it (torch's name).

    Not recursive: sharded submodules keep their shards, as with torch's ``FSDPModule.unshard``.
    Its next forward uses them without gathering again; it frees them afterwards when
    ``reshard_after_forward``. A collective: call it on every rank of the shard group.

    Args:
        module: a module given to ``fully_shard``.
        async_op: start the all-gather and return an :class:`UnshardHandle` to wait on.

    Raises:
        ValueError: ``module`` is not fully sharded.
    """
    unit = _own_unit(module, "unshard")
    if async_op:
        unit.start_gather()
        return UnshardHandle(unit)
    unit.unshard()
    return None


def reshard(module: nn.Module) -> None:
    """Free ``module``'s gathered parameters and register its shards again (torch's name; not recursive).

    Raises:
        ValueError: ``module`` is not fully sharded.
    """
    _own_unit(module, "reshard").reshard()


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients without communication (as DDP's ``no_sync``)."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)


def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip sharded gradients by their global norm; return that norm.

    ``parameters``: the sharded model, or its parameters as torch's
    ``clip_grad_norm_(model.parameters(), ...)`` takes them. ``torch.nn.utils.clip_grad_norm_``
    over the shards would see this rank's pieces only; here each rank's partial norm is
    combined over the shard group first, so every rank scales by the same factor a single
    process would. Padding contributes zeros; parameters that are not shards (a module left
    unsharded) count once. ``error_if_nonfinite`` and ``foreach`` are torch's.

    Raises:
        ValueError: no parameter given is a shard of ``fully_shard`` (use torch's), or the
            shards belong to units sharded over different groups.
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
    """
    del foreach  # one fused all-reduce either way
    plain: list[torch.Tensor] = []
    if isinstance(parameters, nn.Module):
        units = _units(parameters)
        grads = [s.shard.grad for u in units for s in u.flat.trainable if s.shard.grad is not None]
    else:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = [owner_of(p) for p in params]
        units = list({id(u): u for u in owners if u is not None}.values())
        if not units:
            raise ValueError(
                "clip_grad_norm_: none of the parameters given is a shard of lockstep.fully_shard; "
                "for a model that is not sharded use torch.nn.utils.clip_grad_norm_"
            )
        grads = [p.grad for p, u in zip(params, owners) if u is not None and p.grad is not None]
        plain = [p.grad for p, u in zip(params, owners) if u is None and p.grad is not None]
        if len({id(u.shard_group) for u in units}) > 1:
            raise ValueError(
                "clip_grad_norm_: the parameters belong to units sharded over different groups; "
                "clip each group's parameters separately"
            )
    group, device = units[0].shard_group, units[0].flat.device
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local = max((g.detach().abs().max() for g in grads), default=torch.tensor(0.0))
        total = torch.as_tensor(local, dtype=torch.float64, device=device).clone()
        collectives.all_reduce(total, group, op=dist.ReduceOp.MAX,
                               name="clip_grad_norm_ all-reduce (max)")
        for g in plain:
            total = torch.maximum(total, g.detach().abs().max().to(total))
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            total += g.detach().double().norm(norm_type) ** norm_type
        collectives.all_reduce(total, group, name="clip_grad_norm_ all-reduce")
        for g in plain:  # the same on every rank: counted once, after the sum over shards
            total += g.detach().double().norm(norm_type).to(total) ** norm_type
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + plain:
        g.mul_(scale.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (every rank gets it): each shard gathered, padding cut."""
    units = _units(module)
    saved: list[FSDPUnit] = []
    try:
        for unit in units:
            values = unit.flat.gather_full_values(unit.shard_group)
            saved.append(unit)
            unit.flat.use_tensors(values)
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    finally:
        for unit in saved:
            unit.flat.use_shards()
