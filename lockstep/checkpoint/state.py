"""What a run's objects hold: collecting and re-applying model, optimizer, RNG... states.

Anything with ``state_dict()``/``load_state_dict()`` (optimizers, LR schedulers, gradient
scalers, samplers) is treated alike. Models are special only in that a wrapper's prefix
(``module.`` from torch's DDP, ``_orig_mod.`` from ``torch.compile``) never reaches the file, and
a file that has it still loads; a mismatch lists the missing and unexpected keys.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint.fit import check_optimizer_fits, refuse_meta
from lockstep.checkpoint.io import CheckpointError, load_file
from lockstep.fsdp.registry import is_shard, is_sharded
from lockstep.shards import stage_param_of
from lockstep.wrappers import unwrap_model

__all__ = [
    "apply_state",
    "capture_rng",
    "load_model_state",
    "load_weights",
    "object_state",
    "refuse_sharded",
    "restore_rng",
    "unwrap_model",
]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_MAX_LISTED_KEYS = 10


def refuse_sharded(name: str, obj: Any) -> None:
    """Refuse a ``fully_shard`` model or an optimizer of its shards given as they are.

    Their ``state_dict()`` holds this rank's shards only: saved plainly, every rank would
    restore rank 0's pieces. :class:`lockstep.fsdp.ModelState` and ``OptimizerState`` save them.

    Raises:
        TypeError: naming the object and what to pass instead.
    """
    if isinstance(obj, nn.Module) and is_sharded(unwrap_model(obj)):
        what = "a model sharded by lockstep.fully_shard"
    elif isinstance(obj, torch.optim.Optimizer) and any(
            is_shard(p) for group in obj.param_groups for p in group["params"]):
        what = "an optimizer of lockstep.fully_shard's shards"
    else:
        _refuse_stage(name, obj)
        return
    raise TypeError(
        f"cannot checkpoint {name!r}: it is {what}, whose state_dict() holds this rank's shards "
        "only (every rank would restore rank 0's). Pass model=lockstep.fsdp.ModelState(model) "
        "and optimizer=lockstep.fsdp.OptimizerState(model, optimizer) instead (docs/fsdp.md, "
        "Checkpoints)"
    )


def _refuse_stage(name: str, obj: Any) -> None:
    """Refuse a pipeline stage over ranks (or its optimizer) given plainly: rank 0's would be
    saved, and restored on every rank, whose stages differ."""
    if isinstance(obj, nn.Module):
        params = list(obj.parameters())
        instead = "model=pipe (the Pipeline itself)"
    elif isinstance(obj, torch.optim.Optimizer):
        params = [p for group in obj.param_groups for p in group["params"]]
        instead = f"{name}=pipe.optimizer_state({name})"
    else:
        return
    stages = sorted({s for s in map(stage_param_of, params) if s is not None})
    if stages:
        raise TypeError(
            f"cannot checkpoint {name!r}: it holds the parameters of pipeline stage {stages[0]}, "
            "which this rank alone holds (saved plainly, rank 0's stage would be restored on "
            f"every rank). Pass {instead} instead: each rank then saves and restores its "
            "own stage (docs/pipeline.md, Checkpoints)"
        )


def object_state(name: str, obj: Any) -> Any:
    """The state to save for ``obj``: a model's unprefixed weights, else ``obj.state_dict()``."""
    refuse_sharded(name, obj)
    if isinstance(obj, nn.Module):
        return unwrap_model(obj).state_dict()
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return obj.state_dict()
    raise TypeError(
        f"cannot checkpoint {name}={type(obj).__name__}: it has no state_dict()/load_state_dict(); "
        "pass plain values in `extra=` instead"
    )


def apply_state(name: str, obj: Any, state: Any, source: str) -> None:
    """Load ``state`` (read from ``source``) into ``obj`` the way :func:`object_state` saved it."""
    refuse_sharded(name, obj)
    if isinstance(obj, nn.Module):
        load_model_state(obj, state, source)
        return
    if isinstance(obj, torch.optim.Optimizer):
        check_optimizer_fits(name, obj, state, source)
    try:
        obj.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(
            f"{source}: {name!r} does not fit this {type(obj).__name__} "
            f"({type(exc).__name__}: {exc}). Was it saved for another configuration?"
        ) from exc


def _strip_prefixes(state: Mapping[str, Any], expected: Iterable[str] = ()) -> dict[str, Any]:
    """``state`` without the wrappers' prefixes, unless its keys are already ``expected``'s (a
    model whose own child is named ``module``: its keys start with ``module.`` by right)."""
    state = dict(state)
    wanted = set(expected)
    stripped = True
    while stripped and not (wanted and set(state) <= wanted):
        # nested wrappers, e.g. torch.compile(DDP(m)): "_orig_mod.module.w"
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if state and all(key.startswith(prefix) for key in state):
                state = {key[len(prefix):]: value for key, value in state.items()}
                stripped = True
                break
    return state


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = len(keys) - _MAX_LISTED_KEYS
    return shown + (f" and {more} more" if more > 0 else "")


def load_model_state(model: nn.Module, state: Mapping[str, Any], source: str) -> None:
    """Load weights into ``model`` (wrapped or not), whether or not keys carry ``module.``.

    Raises:
        CheckpointError: keys or shapes differ; the message lists them and names ``source``.
    """
    target = unwrap_model(model)
    refuse_meta(target, source)
    expected = target.state_dict()
    state = _strip_prefixes(state, expected)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(
        f"{key} {tuple(state[key].shape)} vs {tuple(value.shape)}"
        for key, value in expected.items()
        if key in state and isinstance(value, torch.Tensor) and state[key].shape != value.shape
    )
    if missing or unexpected or reshaped:
        problems = []
        if missing:
            problems.append(f"missing keys: {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_listed(unexpected)}")
        if reshaped:
            problems.append(f"shape mismatch (file vs model): {_listed(reshaped)}")
        raise CheckpointError(
            f"{source} holds weights of another model ({'; '.join(problems)}). Build the same "
            "architecture that wrote it, or point at the right checkpoint directory."
        )
    target.load_state_dict(state)


def load_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a weights file into ``model``: torch's DDP (``module.`` keys), plain or safetensors.

    Nothing but tensors and plain containers is unpickled, whoever wrote the file.

    Example::

        lockstep.load_weights(model, "torch_ddp_model.pt")

    Raises:
        CheckpointError: the file is damaged, unsafe, or holds another model's weights.
    """
    state = load_file(os.fspath(path))
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of weights")
    load_model_state(model, state, str(path))


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states: Python, NumPy (if installed), torch."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is not None:
        kind, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            # int64 because older torch cannot hold uint32 tensors.
            "key": torch.from_numpy(key.astype(np.int64)),  # type: ignore[attr-defined]
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    # An uninitialised CUDA has drawn nothing; asking would start it in a CPU-only job.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` took (parts this machine lacks are skipped)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None  # type: ignore[assignment]
        if np is not None:
            saved = state["numpy"]
            key = saved["key"].numpy().astype(np.uint32)
            np.random.set_state(
                (saved["kind"], key, saved["pos"], saved["has_gauss"], saved["cached"])
            )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
