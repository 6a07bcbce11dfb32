"""DDP's constructor arguments, checked where they are given, at every world size.

Each check turns a value torch's ``DistributedDataParallel`` accepts into what lockstep's wrapper
uses, or raises an error that names the argument, what was passed and what to do.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.comm.fp32_accumulate import check_wire_dtype
from lockstep.ddp.bucket import MB
from lockstep.virtual_world import VIRTUAL_SHARDS_ENV

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "bucket_cap_bytes",
    "buffer_sync_flags",
    "check_device_ids",
    "check_mixed_precision",
    "check_module",
    "check_reduce_dtype",
    "communication_options",
    "resolve_process_group",
    "warn_check_reduction",
]

DEFAULT_BUCKET_CAP_MB = 25


def check_module(module: Any) -> None:
    """Raise a TypeError unless ``module`` is an ``nn.Module`` (not a function, tensor, ...)."""
    if isinstance(module, nn.Module):
        return
    if isinstance(module, torch.Tensor):
        what = f"a tensor of shape {list(module.shape)}"
    elif callable(module):
        what = f"the callable {getattr(module, '__qualname__', type(module).__name__)}"
    else:
        what = f"{type(module).__name__} {module!r:.60}"
    raise TypeError(
        f"DistributedDataParallel wraps a torch.nn.Module, got {what}. Wrap the model that holds "
        "the parameters, e.g. DistributedDataParallel(Net().to(device)); a plain function has "
        "no parameters to synchronise."
    )


def _check_mb(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"DistributedDataParallel: {name} must be a number of MiB (int or float), got "
            f"{type(value).__name__} {value!r}; e.g. {name}={DEFAULT_BUCKET_CAP_MB}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"DistributedDataParallel: {name}={value!r} must be a positive, finite size in MiB "
            f"(the default is {DEFAULT_BUCKET_CAP_MB}; smaller buckets start reducing earlier)"
        )
    return float(value)


def bucket_cap_bytes(bucket_cap_mb: Any, bucket_cap_mb_list: Sequence[Any] | None) -> int:
    """The bucket size in bytes from ``bucket_cap_mb`` or torch's per-bucket ``bucket_cap_mb_list``.

    torch sizes each bucket from its own list entry; lockstep's buckets share one size, so a
    list gives the largest entry, which is also what torch uses as its overall cap.

    Raises:
        TypeError: a size that is not a number (e.g. the string ``"25"``), or a list that is
            not a list.
        ValueError: a size that is zero, negative or not finite, or an empty list.
    """
    if bucket_cap_mb_list is not None:
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(
            bucket_cap_mb_list, Sequence
        ):
            raise TypeError(
                "DistributedDataParallel: bucket_cap_mb_list must be a list of sizes in MiB, "
                f"got {type(bucket_cap_mb_list).__name__} {bucket_cap_mb_list!r}"
            )
        sizes = [_check_mb(f"bucket_cap_mb_list[{i}]", v) for i, v in enumerate(bucket_cap_mb_list)]
        if sizes:  # torch treats an empty list as "not given"
            return max(1, int(max(sizes) * MB))  # below a byte: a bucket per parameter, as torch
    if bucket_cap_mb is None:
        return DEFAULT_BUCKET_CAP_MB * MB
    return max(1, int(_check_mb("bucket_cap_mb", bucket_cap_mb) * MB))


def communication_options(
    *,
    find_unused_parameters: bool,
    static_graph: bool,
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    broadcast_buffers: bool,
    forward_sync_buffers: bool,
    mixed_precision_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    delayed_names: Sequence[str],
) -> dict[str, Any]:
    """The options that must agree across ranks, named as the user passes them.

    Each changes which collectives a step runs or their sizes: compared across ranks at
    construction (``replica_sync.verify_same_parameters``). ``gradient_as_bucket_view`` and
    ``skip_all_reduce_unused_params`` send the same bytes either way and are left out.
    ``broadcast_buffers`` is the buffer broadcast at construction, ``forward_sync_buffers`` the
    one before each forward (``broadcast_buffers=False`` turns off both). The bucket size is
    the one asked for (already checked by :func:`bucket_cap_bytes`): the list's largest entry,
    else ``bucket_cap_mb``, else the default.
    """
    asked = (max(bucket_cap_mb_list) if bucket_cap_mb_list
             else DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
    return {
        "find_unused_parameters": bool(find_unused_parameters),
        "static_graph": bool(static_graph),
        "bucket_cap_mb": float(asked),
        "broadcast_buffers": bool(broadcast_buffers),
        "forward_sync_buffers": bool(forward_sync_buffers),
        "mixed_precision.reduce_dtype": None if mixed_precision_dtype is None else str(mixed_precision_dtype),
        "reduce_dtype": None if reduce_dtype is None else str(reduce_dtype),
        "delay_all_reduce_named_params": list(delayed_names),
    }


def resolve_process_group(process_group: Any, device_mesh: Any) -> Any:
    """The group to average over: ``process_group``, the group of a 1-D ``device_mesh``, or WORLD.

    Raises:
        RuntimeError: both are given, or the mesh has more than one dimension (as torch).
    """
    if device_mesh is None:
        return process_group if process_group is not None else dist.group.WORLD
    if process_group is not None:
        raise RuntimeError(
            "DistributedDataParallel: pass process_group or device_mesh, not both (the mesh "
            "already names the group to average over)."
        )
    if device_mesh.ndim != 1:
        raise RuntimeError(
            f"DistributedDataParallel: device_mesh must be 1-D (the data-parallel dimension), "
            f"got {device_mesh.ndim} dimensions {device_mesh.mesh_dim_names or ''}; pass the "
            "data-parallel slice, e.g. mesh['dp']."
        )
    return device_mesh.get_group(mesh_dim=0)


def check_device_ids(
    device_ids: Sequence[Any] | None, output_device: Any, device: torch.device
) -> list[Any] | None:
    """``device_ids`` as a list, or None; only a single-device CUDA (accelerator) model takes one.

    Raises:
        ValueError: several devices, or ``device_ids``/``output_device`` for a CPU model.
    """
    ids = list(device_ids) if device_ids else None
    if ids is not None and len(ids) != 1:
        raise ValueError(
            f"device_ids={ids}: lockstep's DDP drives one device per process; "
            "pass device_ids=[local_rank] (or None) and start one process per device."
        )
    if device.type == "cpu" and (ids is not None or output_device is not None):
        given = f"device_ids={ids}" if ids is not None else f"output_device={output_device!r}"
        raise ValueError(
            f"DistributedDataParallel: the model is on the CPU, but {given} is for a model on a "
            "CUDA device (it names the GPU this process drives). Leave device_ids and "
            "output_device out for a CPU model, or move the model to its GPU first: "
            "model.to(info.device)."
        )
    return ids


def buffer_sync_flags(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """(sync buffers before each forward, sync buffers at construction), as torch 2.13 decides.

    ``forward_sync_buffers`` (torch 2.13's name) controls only the forward; buffers are still
    broadcast at construction. The older ``broadcast_buffers=False`` turns off both.
    """
    if forward_sync_buffers is not None:
        if broadcast_buffers is not None:
            warnings.warn(
                "DistributedDataParallel: both broadcast_buffers and forward_sync_buffers were "
                "given; forward_sync_buffers wins (broadcast_buffers is its older name).",
                FutureWarning,
                stacklevel=3,
            )
        return bool(forward_sync_buffers), True
    value = True if broadcast_buffers is None else bool(broadcast_buffers)
    return value, value


def check_mixed_precision(mixed_precision: Any) -> torch.dtype | None:
    """The ``reduce_dtype`` of torch's ``_MixedPrecision`` (or any object with its fields).

    Raises:
        ValueError: ``param_dtype`` or ``buffer_dtype`` is set: lockstep computes in the
            parameters' own dtype; ``torch.autocast`` gives low-precision compute instead.
        TypeError: ``reduce_dtype`` is not a floating-point dtype.
    """
    if mixed_precision is None:
        return None
    for field in ("param_dtype", "buffer_dtype"):
        if getattr(mixed_precision, field, None) is not None:
            raise ValueError(
                f"DistributedDataParallel: mixed_precision.{field}="
                f"{getattr(mixed_precision, field)} is not supported by lockstep (its DDP keeps "
                "parameters and buffers in their own dtype; torch's implementation of this "
                "field needs CUDA streams). For low-precision compute use torch.autocast around "
                "the forward; reduce_dtype (gradients averaged in another dtype) is supported."
            )
    dtype = getattr(mixed_precision, "reduce_dtype", None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"DistributedDataParallel: mixed_precision.reduce_dtype must be a floating-point "
            f"torch.dtype such as torch.float16, got {dtype!r}"
        )
    return dtype


def check_reduce_dtype(reduce_dtype: Any, mixed_precision_dtype: torch.dtype | None) -> torch.dtype | None:
    """lockstep's ``reduce_dtype=``: the dtype gradients travel in, their mean added up in fp32.

    Raises:
        TypeError: not a floating-point ``torch.dtype``.
        ValueError: ``mixed_precision.reduce_dtype`` is set too (two reductions for one model).
    """
    if reduce_dtype is None:
        return None
    check_wire_dtype(reduce_dtype, "DistributedDataParallel: reduce_dtype")
    if mixed_precision_dtype is not None:
        raise ValueError(
            f"DistributedDataParallel: reduce_dtype={reduce_dtype} and mixed_precision.reduce_dtype="
            f"{mixed_precision_dtype} were both given. Pass one: reduce_dtype (lockstep) sends "
            "gradients in that dtype and adds them up in fp32; mixed_precision (torch's) also "
            "sums in that dtype, which drifts as ranks are added."
        )
    return reduce_dtype


def warn_virtual_shards_unused() -> None:
    """Under ``lockstep run --virtual-shards V`` a plain DDP model gets none of its guarantee:
    say so once per process (the launcher cannot see which wrapper the script uses)."""
    value = os.environ.get(VIRTUAL_SHARDS_ENV)
    if value is None:
        return
    warnings.warn(
        f"DistributedDataParallel under `lockstep run --virtual-shards {value}`: this wrapper "
        "does not use virtual shards, so the run is not the same at every world size. Wrap the "
        "model in lockstep.VirtualShardDDP (and batch with VirtualShardSampler) for that, or "
        "drop --virtual-shards (docs/virtual-shards.md)",
        UserWarning,
        stacklevel=3,
    )


def warn_check_reduction() -> None:
    """``check_reduction=True`` does nothing (in torch too): say so once, as torch does."""
    warnings.warn(
        "DistributedDataParallel: check_reduction is deprecated (in torch as well) and has no "
        "effect: every backward already checks that all gradients were reduced.",
        FutureWarning,
        stacklevel=3,
    )
