"""Run replicas at the same time, one thread per device, and re-raise their errors in the caller.

Threads suit this because the heavy work (CUDA kernels, or torch's CPU ops) releases the GIL.
Grad mode, inference mode and autocast are thread-local in torch, so the caller's settings are
carried into every worker; on CUDA each worker also enters its device and that device's current
stream as seen by the caller, where scatter queued the input copies, so the replica's kernels
run after them with no extra synchronisation while devices still run side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lockstep.dp.cpu_rng import TakeTurns
from lockstep.dp.devices import DeviceLike, as_device

__all__ = ["parallel_apply"]


def parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike] | None = None,
    *,
    cpu_in_order: bool = False,
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs_tup[i])`` for every ``i``, each in its own thread.

    Args:
        modules: the replicas (any callables).
        inputs: one argument tuple per replica (a non-tuple is passed as the only argument).
        kwargs_tup: one keyword dict per replica.
        devices: the device of each replica; by default that of its first parameter, else CPU.
        cpu_in_order: when every replica runs on the CPU, run them one after another in
            replica order (still one thread each), so that they draw from torch's one CPU
            generator as a single process would (:mod:`lockstep.dp.cpu_rng`): dropout masks
            are reproducible and differ between replicas. DataParallel sets it; by default CPU
            replicas run at the same time.

    Returns:
        The outputs, in replica order.

    Raises:
        Exception: the first failing replica's exception, same type where possible, with a
            message naming the replica and its device and the original chained as ``__cause__``.

    Example:
        >>> parallel_apply([torch.neg, torch.neg], [(torch.ones(1),), (torch.zeros(1),)])
        [tensor([-1.]), tensor([-0.])]
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(
            f"parallel_apply got {n} modules but {len(inputs)} inputs; pass one input per module"
        )
    kwargs_list = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in range(n)]
    if len(kwargs_list) != n:
        raise ValueError(
            f"parallel_apply got {n} modules but {len(kwargs_list)} kwargs; pass one dict per module"
        )
    if devices is not None:
        devs = [as_device(d) for d in devices]
    else:
        devs = [_device_of(m) for m in modules]
    state = _ThreadState.capture(devs)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    in_order = cpu_in_order and n > 1 and all(d.type == "cpu" for d in devs)
    turns = TakeTurns() if in_order else None

    def work(i: int) -> None:
        args = inputs[i] if isinstance(inputs[i], (tuple, list)) else (inputs[i],)
        try:
            # The turn first: it must be handed on even if entering the state fails.
            with (turns.turn(i) if turns else contextlib.nullcontext()), state.enter(devs[i]):
                results[i] = modules[i](*args, **kwargs_list[i])
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller below
            errors[i] = exc

    if n == 1:
        work(0)  # no thread for a single replica: nothing to overlap with
    else:
        threads = [
            threading.Thread(target=work, args=(i,), name=f"lockstep-replica-{i}") for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _raise_first(errors, devs)
    return results


def _raise_first(errors: list[BaseException | None], devices: list[torch.device]) -> None:
    failed = [i for i, e in enumerate(errors) if e is not None]
    if not failed:
        return
    i, exc = failed[0], errors[failed[0]]
    assert exc is not None
    others = f" ({len(failed) - 1} other replica(s) failed too)" if len(failed) > 1 else ""
    message = f"replica {i} on device {devices[i]} raised {type(exc).__name__}: {exc}{others}"
    try:
        wrapped = type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type whose constructor wants other arguments
        wrapped = RuntimeError(message)
    raise wrapped from exc


def _device_of(module: Any) -> torch.device:
    if isinstance(module, torch.nn.Module):
        for param in module.parameters():
            return param.device
        for buffer in module.buffers():
            return buffer.device
    return torch.device("cpu")


class _ThreadState:
    """The caller's thread-local torch settings, re-entered inside each worker thread."""

    def __init__(self, grad: bool, inference: bool, autocast: dict[str, tuple[bool, torch.dtype]],
                 streams: dict[torch.device, Any]) -> None:
        self.grad = grad
        self.inference = inference
        self.autocast = autocast
        self.streams = streams

    @classmethod
    def capture(cls, devices: list[torch.device]) -> _ThreadState:
        types = {d.type for d in devices}
        autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types}
        # Only touch the CUDA API when a replica runs there: CPU stays CUDA-free.
        streams = {d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"}
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, streams)

    @contextlib.contextmanager
    def enter(self, device: torch.device) -> Iterator[None]:
        enabled, dtype = self.autocast[device.type]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if enabled:
                stack.enter_context(torch.autocast(device.type, dtype=dtype))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield
