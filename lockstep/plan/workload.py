"""What one GPU does in one step: the planner's input, read from a profile or described by hand.

A :class:`Workload` holds per-step seconds at one per-GPU batch (data, forward, backward,
optimizer), the gradient buckets in launch order with the moment each becomes ready after
backward starts, the model's size, and the buffers DDP broadcasts before every forward. :func:`load_profile` reads the doctor's ``profile.json``
(docs/profile-format.md); :func:`describe` builds one from a parameter count and a step time or
flops for what-if questions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lockstep.plan.links import Link
from lockstep.plan.stragglers import spread_of

__all__ = [
    "DTYPE_BYTES",
    "Bucket",
    "ProfileError",
    "Workload",
    "describe",
    "load_profile",
    "synthetic_buckets",
]

MB = 1024 * 1024
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "float64": 8}


class ProfileError(ValueError):
    """A profile file that cannot be read as ``lockstep-profile`` version 1."""


@dataclass(frozen=True)
class Bucket:
    """``nbytes`` of gradients that become ready ``ready`` seconds after backward starts."""

    nbytes: float
    ready: float


@dataclass(frozen=True)
class Workload:
    """One GPU's step at ``batch_size`` samples; times in seconds, sizes in bytes."""

    parameters: int
    grad_dtype: str
    forward: float
    backward: float
    optimizer: float = 0.0
    data: float = 0.0
    other: float = 0.0  # the rest of the profiled step (Python, zero_grad, hooks): never hidden
    batch_size: int | None = None
    buckets: tuple[Bucket, ...] = ()
    device: str = "cuda"
    source: str = "described"
    link: Link | None = None  # measured by the profiler, if it did
    notes: tuple[str, ...] = field(default=())
    # Bytes of each message DDP broadcasts from rank 0 before every forward (BatchNorm's running
    # statistics: one message per buffer dtype); empty: no buffers, or broadcast_buffers=False.
    buffer_broadcasts: tuple[float, ...] = ()
    # Spread (std / mean) of the ranks' compute per step, from the profile's per_rank phases
    # (None: one rank profiled, or no per-rank phases); prices the wait for the slowest of N.
    step_cv: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.parameters <= MAX_PARAMETERS:
            raise ValueError(f"parameter count must be positive and at most {MAX_PARAMETERS:.0e} "
                             f"(the planner prices DDP's buckets one by one), got {self.parameters}")
        if self.grad_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.grad_dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        for name in ("forward", "backward", "optimizer", "data", "other"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} time must be a finite number of seconds >= 0, got "
                                 f"{getattr(self, name)}")
        if not self.forward + self.backward > 0:
            raise ValueError("forward and backward times are both 0: a step with no compute has "
                             "nothing to scale (give the measured seconds of one step)")
        if not math.isfinite(self.compute):
            raise ValueError(f"the step's phases sum to {self.compute} seconds (each finite, the "
                             "total overflows): give the measured seconds of one step")
        if self.batch_size is not None and not (type(self.batch_size) is int and self.batch_size > 0):
            raise ValueError(f"batch size must be a positive int, got {self.batch_size!r}")
        if not all(math.isfinite(b) and b >= 0 for b in self.buffer_broadcasts):
            raise ValueError(f"buffer broadcast sizes must be finite bytes >= 0, got "
                             f"{list(self.buffer_broadcasts)}")
        if not self.buckets:
            object.__setattr__(self, "buckets", synthetic_buckets(self.grad_bytes, self.backward))

    @property
    def grad_bytes(self) -> float:
        return self.parameters * DTYPE_BYTES[self.grad_dtype]

    @property
    def compute(self) -> float:
        """Seconds of a step on one GPU with no communication at all."""
        return self.data + self.forward + self.backward + self.optimizer + self.other

    def with_batch(self, batch_size: int) -> Workload:
        """The same model at another per-GPU batch: data, forward and backward scale linearly.

        The optimizer and ``other`` (Python between the phases, ``zero_grad``, hooks: work per
        step or per parameter, not per sample) stay as measured. Until 2026-11-29 ``other`` was
        rescaled too.
        """
        if self.batch_size is None:
            raise ValueError("this workload has no batch size; cannot rescale it")
        k = batch_size / self.batch_size
        buckets = tuple(Bucket(b.nbytes, b.ready * k) for b in self.buckets)
        return replace(self, batch_size=batch_size, data=self.data * k, forward=self.forward * k,
                       backward=self.backward * k, buckets=buckets)


def synthetic_buckets(grad_bytes: float, backward: float, cap_bytes: float = 25 * MB,
                      first_cap_bytes: float = 1 * MB, last_bytes: float = 0.0
                      ) -> tuple[Bucket, ...]:
    """DDP's buckets when only the total is known: 1 MB first, then 25 MB; gradients assumed to
    arrive at a constant rate in bytes over backward, so a bucket is ready when its last byte is.

    ``last_bytes`` (the input layer's gradient: an embedding) are computed last by backward, so
    they are ready only when it ends; DDP fills buckets in the reverse order of the parameters
    and gives a tensor larger than the cap a bucket of its own (PyTorch's DDP design note,
    docs.pytorch.org/docs/stable/notes/ddp.html). They make one last bucket ready at
    ``backward``; the other ``grad_bytes - last_bytes`` arrive at a constant rate before it.
    """
    if not 0 <= last_bytes <= grad_bytes:
        raise ValueError(f"last_bytes must be between 0 and grad_bytes ({grad_bytes}), got "
                         f"{last_bytes}")
    body = grad_bytes - last_bytes
    buckets: list[Bucket] = []
    if body > 0:  # the first bucket, then full ones, then the rest (counted, not summed on)
        ends = [min(first_cap_bytes, body)]
        full = math.ceil((body - ends[0]) / cap_bytes) if body > ends[0] else 0
        ends += [min(ends[0] + k * cap_bytes, body) for k in range(1, full + 1)]
        buckets = [Bucket(end - start, backward * end / body)
                   for start, end in zip([0.0, *ends], ends)]
    if last_bytes > 0:
        buckets.append(Bucket(last_bytes, backward))
    return tuple(buckets)


# The most parameters a plan prices: DDP's 25 MB buckets are priced one by one (1e12 bf16
# gradients are 80,000 buckets, about 90 s of pricing on a laptop-class core).
MAX_PARAMETERS = 2e12


def describe(parameters: float, *, step_time: float | None = None,
             flops_per_sample: float | None = None, gpu_flops: float | None = None,
             utilization: float = 0.4, batch_size: int = 1, dtype: str = "bfloat16",
             optimizer_time: float = 0.0, data_time: float = 0.0,
             device: str = "cuda", buffer_bytes: float = 0.0,
             input_parameters: float = 0.0) -> Workload:
    """A what-if workload from a model's size and either its measured or its computed step time.

    Args:
        parameters: trainable parameter count.
        step_time: measured seconds of forward + backward for ``batch_size`` samples on one GPU.
        flops_per_sample: training flops per sample (about 6 x parameters x tokens for a
            transformer); with ``gpu_flops`` (peak flop/s) and ``utilization`` gives the time.
        dtype: dtype of the reduced gradients.
        buffer_bytes: bytes of the module's buffers (BatchNorm's running statistics), which
            DDP broadcasts from rank 0 before every forward, priced as one message.
        input_parameters: parameters of the input layer (a transformer's token, position and
            type embeddings; a convnet's first convolution). Backward computes their gradient
            last, so it is ready only when backward ends and its all-reduce cannot hide: it is
            priced as a last bucket of its own, ready at the end of backward (the rest arrive
            at a constant rate). 0 (the default): the old uniform arrival.

    Forward takes a third of the compute and backward two thirds (backward computes gradients
    with respect to both activations and weights).
    """
    for name, value in (("parameters", parameters), ("step_time", step_time),
                        ("flops_per_sample", flops_per_sample), ("gpu_flops", gpu_flops),
                        ("utilization", utilization), ("optimizer_time", optimizer_time),
                        ("data_time", data_time), ("buffer_bytes", buffer_bytes),
                        ("input_parameters", input_parameters)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    if not 0 < parameters <= MAX_PARAMETERS:
        raise ValueError(f"parameters must be positive and at most {MAX_PARAMETERS:.0e}, got {parameters}")
    if not (type(batch_size) is int and batch_size > 0):
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if (step_time is None) == (flops_per_sample is None):
        raise ValueError("give either step_time (seconds) or flops_per_sample (with gpu_flops)")
    if step_time is None:
        if gpu_flops is None:
            raise ValueError("flops_per_sample needs gpu_flops, the GPU's peak flop/s")
        if gpu_flops <= 0 or flops_per_sample <= 0:  # type: ignore[operator]
            raise ValueError(f"flops_per_sample and gpu_flops must be positive, got "
                             f"{flops_per_sample} and {gpu_flops}")
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization}")
        step_time = float(flops_per_sample) * batch_size / (gpu_flops * utilization)  # type: ignore[arg-type]
    if step_time <= 0:
        raise ValueError(f"step time must be positive, got {step_time}")
    if not buffer_bytes >= 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
    if not 0 <= input_parameters <= parameters:
        raise ValueError(f"input_parameters must be between 0 and the parameter count "
                         f"({parameters}), got {input_parameters}")
    backward = 2 * step_time / 3
    width = DTYPE_BYTES.get(dtype, 0)
    buckets = (synthetic_buckets(int(parameters) * width, backward,
                                 last_bytes=input_parameters * width)
               if width and input_parameters > 0 else ())
    note = (f"the input layer's {input_parameters * width:,.0f} bytes of gradients: one last "
            "bucket, ready when backward ends")
    return Workload(parameters=int(parameters), grad_dtype=dtype, forward=step_time / 3,
                    backward=backward, optimizer=optimizer_time, data=data_time,
                    batch_size=batch_size, device=device, source="described", buckets=buckets,
                    notes=(note,) if buckets else (),
                    buffer_broadcasts=(float(buffer_bytes),) if buffer_bytes > 0 else ())


def _need(obj: dict, key: str, where: str, path: str) -> Any:
    if not isinstance(obj, dict):
        raise ProfileError(f"{path}: {where.rstrip('.') or 'the profile'} must be an object, got {obj!r}")
    if key not in obj:
        raise ProfileError(f"{path}: missing field {where}{key!r}; is this a lockstep profile "
                           "(docs/profile-format.md)?")
    return obj[key]


def load_profile(path: str | Path) -> Workload:
    """Read a ``lockstep-profile`` (version 1) JSON file into a :class:`Workload`.

    Raises:
        ProfileError: the file is not JSON, or misses a required field (named in the message).
    """
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except IsADirectoryError:
        raise ProfileError(f"{path}: is a directory, not a profile file (the doctor writes "
                           "DIR/profile.json)") from None
    except OSError as err:
        raise ProfileError(f"{path}: cannot read the profile ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileError(f"{path}: not JSON ({err})") from None
    if _need(doc, "format", "", path) != "lockstep-profile":
        raise ProfileError(f"{path}: format is {doc['format']!r}, expected 'lockstep-profile'")
    version = _need(doc, "version", "", path)
    if type(version) is not int or version != 1:
        raise ProfileError(f"{path}: profile version {version!r}; this planner reads version 1")
    world = _need(doc, "world_size", "", path)
    if type(world) is not int or world < 1:
        raise ProfileError(f"{path}: field world_size must be a whole number >= 1, got {world!r}")
    model, phases = _need(doc, "model", "", path), _need(doc, "phases", "", path)
    for name, part in (("model", model), ("phases", phases)):
        if not isinstance(part, dict):
            raise ProfileError(f"{path}: field {name} must be an object, got {part!r}")
    times = {key: _number(_need(phases, key, "phases.", path) if key in ("forward", "backward")
                          else phases.get(key, 0.0), f"phases.{key}", path)
             for key in ("data", "forward", "backward", "optimizer", "exposed_comm")}
    if "trainable_parameters" in model:
        count_field = "model.trainable_parameters"
        trainable = _number(model["trainable_parameters"], count_field, path, True)
    else:
        count_field = "model.parameters"
        trainable = _number(_need(model, "parameters", "model.", path), count_field, path, True)
    if not 0 < trainable <= MAX_PARAMETERS:
        raise ProfileError(f"{path}: field {count_field} must be between 1 and {MAX_PARAMETERS:.0e} "
                           f"(a model with nothing to train has nothing to synchronise), got {trainable:g}")
    raw_dtype = model.get("dtype", "float32")
    dtype = raw_dtype.replace("torch.", "") if isinstance(raw_dtype, str) else raw_dtype
    if dtype not in DTYPE_BYTES:
        raise ProfileError(f"{path}: field model.dtype is {raw_dtype!r}; the planner prices gradients "
                           f"of {', '.join(DTYPE_BYTES)}")
    raw_buckets = doc.get("buckets") or []
    if not isinstance(raw_buckets, list):
        raise ProfileError(f"{path}: field buckets must be a list, got {raw_buckets!r}")
    buckets = tuple(Bucket(_number(_need(b, "bytes", f"buckets[{i}].", path), f"buckets[{i}].bytes", path),
                           _number(_need(b, "ready", f"buckets[{i}].", path), f"buckets[{i}].ready", path))
                    for i, b in enumerate(raw_buckets))
    link = None
    if isinstance(doc.get("link"), dict) and {"alpha", "beta"} <= set(doc["link"]):
        beta = _number(doc["link"]["beta"], "link.beta", path)
        if beta <= 0:
            raise ProfileError(f"{path}: field link.beta must be > 0 bytes/s, got {beta:g}")
        link = Link("measured", _number(doc["link"]["alpha"], "link.alpha", path), beta,
                    f"measured ({path})")
    batch = doc.get("batch_size_per_rank")
    if batch is not None and (type(batch) is not int or batch < 1):
        raise ProfileError(f"{path}: field batch_size_per_rank must be a positive integer or "
                           f"null, got {batch!r}")
    device = doc.get("device") or "cpu"
    if not isinstance(device, str):
        raise ProfileError(f"{path}: field device must be a string such as 'cuda:0' or 'cpu', got {device!r}")
    known = sum(times.values())
    _check_phases(times, known, path)
    # The step's wall time beyond the named phases (Python between them, zero_grad, hooks).
    other = max(0.0, _number(phases.get("step", known), "phases.step", path) - known)
    notes: tuple[str, ...] = ()
    buckets, late = _clamped(_checked(buckets, path), times["backward"], path)
    notes += late
    if not buckets:
        notes += (("synthetic buckets: the profile lists none (world 1?), so DDP's 1 MB + 25 MB "
                   "buckets are assumed, ready uniformly over backward"),)
    broadcasts = _buffer_broadcasts(model, path)
    if broadcasts is None:
        notes += (("the profile records no buffers (written before the doctor did): DDP's "
                   "buffer broadcast before each forward is not priced"),)
    return Workload(
        parameters=int(trainable), grad_dtype=dtype,
        forward=times["forward"], backward=times["backward"],
        optimizer=times["optimizer"], data=times["data"],
        other=other, batch_size=batch, buckets=buckets,
        device=device.split(":")[0], source=path, link=link, notes=notes,
        buffer_broadcasts=broadcasts or (), step_cv=_per_rank_cv(doc, path),
    )


def _number(value: Any, field: str, path: str, integer: bool = False) -> float:
    """A profile's number: finite and >= 0 (an integer where ``integer``), else an error naming
    the file and the field."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and value >= 0 and (not integer or float(value).is_integer()))
    if not ok:
        kind = "a whole number" if integer else "a finite number"
        raise ProfileError(f"{path}: field {field} must be {kind} >= 0, got {value!r}")
    return float(value)


def _per_rank_cv(doc: dict, path: str = "profile") -> float | None:
    """Spread of forward + backward + optimizer over the profile's ``per_rank`` entries."""
    per_rank = doc.get("per_rank")
    if not isinstance(per_rank, list):
        return None
    times = []
    for i, entry in enumerate(per_rank):
        phases = entry.get("phases") if isinstance(entry, dict) else None
        if isinstance(phases, dict):
            times.append(sum(_number(phases.get(k, 0.0) or 0.0, f"per_rank[{i}].phases.{k}", path)
                             for k in ("forward", "backward", "optimizer")))
    return spread_of(times)


def _buffer_broadcasts(model: dict, path: str) -> tuple[float, ...] | None:
    """``model.buffer_broadcasts`` (bytes per message), or one message of ``buffer_bytes``;
    None when the profile has neither (an older profile: nothing is known)."""
    if "buffer_broadcasts" in model:
        raw = model["buffer_broadcasts"]
        field_name = "model.buffer_broadcasts"
    elif "buffer_bytes" in model:
        size = _number(model["buffer_bytes"], "model.buffer_bytes", path)
        return (size,) if size else ()
    else:
        return None
    try:
        if not isinstance(raw, list) or any(isinstance(x, (bool, str)) for x in raw):
            raise TypeError(field_name)
        sizes = tuple(float(x) for x in raw)
    except (TypeError, ValueError):
        raise ProfileError(f"{path}: {field_name} must be a list of byte counts, got {raw!r}") from None
    if not all(math.isfinite(x) and x >= 0 for x in sizes):
        raise ProfileError(f"{path}: {field_name} has {list(sizes)}; sizes must be finite and >= 0")
    return sizes


def _checked(buckets: tuple[Bucket, ...], path: str) -> tuple[Bucket, ...]:
    for i, b in enumerate(buckets):
        if not (math.isfinite(b.nbytes) and b.nbytes >= 0 and math.isfinite(b.ready) and b.ready >= 0):
            raise ProfileError(f"{path}: buckets[{i}] has bytes={b.nbytes}, ready={b.ready}; "
                               "both must be finite and >= 0")
    return buckets


def _check_phases(times: dict[str, float], known: float, path: str) -> None:
    """Refuse phases a step cannot have: no compute at all, or a total that overflows."""
    if not times["forward"] + times["backward"] > 0:
        raise ProfileError(f"{path}: fields phases.forward and phases.backward are both 0: a step "
                           "with no compute has nothing to plan (is this the profile of a training "
                           "run? docs/profile-format.md)")
    if not math.isfinite(known):
        named = ", ".join(f"{k} {v:g}" for k, v in times.items() if v)
        raise ProfileError(f"{path}: the phases sum to {known} seconds ({named}): each is finite, "
                           "their total overflows; the profile's times are seconds per step")


def _clamped(buckets: tuple[Bucket, ...], backward: float, path: str
             ) -> tuple[tuple[Bucket, ...], tuple[str, ...]]:
    """Buckets ready after backward ends, moved to its end, with a note naming them.

    A gradient cannot be ready after backward's compute: such a time is a mean over other steps
    than ``phases.backward``'s, or a broken profile; priced as is, it would hold the whole step.
    """
    late = [i for i, b in enumerate(buckets) if b.ready > backward]
    if not late:
        return buckets, ()
    worst = max(buckets[i].ready for i in late)
    note = (f"{path}: {len(late)} bucket(s) (buckets[{late[0]}]"
            f"{', ...' if len(late) > 1 else ''}) ready after backward ends (up to {worst:g} s, "
            f"backward {backward:g} s): clamped to the end of backward; check the profile")
    return tuple(Bucket(b.nbytes, min(b.ready, backward)) for b in buckets), (note,)
