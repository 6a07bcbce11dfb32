"""The comm-hook interface: how a bucket of gradients is reduced across ranks.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: it receives a
:class:`GradBucket` (one flat tensor holding several parameters' gradients) and returns a future
whose value is the reduced flat tensor, already averaged. The interface matches torch's, so
torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``) also run under lockstep's DDP.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lockstep.diagnose.hang import LocalUsageError

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "check_annotations", "completed_future",
           "returns_future"]


class GradBucket:
    """One bucket of gradients handed to a comm hook.

    Args:
        index: position of the bucket in launch order (0 is reduced first).
        buffer: the flat tensor holding every gradient of the bucket, back to back.
        parameters: the parameters whose gradients live in ``buffer``, in buffer order.
        offsets: start of each parameter's gradient in ``buffer``.
        is_last: whether this is the last bucket of the iteration.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.nn.Parameter],
        offsets: list[int],
        is_last: bool,
    ) -> None:
        self._index = index
        # A complex bucket is handed over as its flat real view, as torch's reducer does (so
        # that casts, e.g. fp16 compression, keep the imaginary parts).
        self._complex = buffer.is_complex()
        self._buffer = torch.view_as_real(buffer).view(-1) if self._complex else buffer
        self._parameters = parameters
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the bucket's buffer, as torch's does: a wrapper hook (torch's
        ``fp16_compress_wrapper``) hands its inner hook a buffer of another dtype this way. The
        reducer copies the hook's result back into its own buffer."""
        self._buffer = tensor

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._parameters)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view of the current buffer (the one given to
        :meth:`set_buffer`, if any, in its dtype, as torch's), shaped like the parameter; a
        complex parameter's as its real view (a last dimension of 2)."""
        per = 2 if self._complex else 1  # real values per element of the bucket
        out = []
        for p, off in zip(self._parameters, self._offsets):
            flat = self._buffer[off * per: (off + p.numel()) * per]
            out.append(flat.view(*p.shape, 2) if self._complex else flat.view(p.shape))
        return out

    def offsets(self) -> list[int]:
        return list(self._offsets)

    def is_last(self) -> bool:
        return self._is_last


CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def completed_future(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds ``value`` (for hooks that need no communication)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The default hook: the mean over ranks by one asynchronous all-reduce.

    Dividing before the sum (not after) keeps fp16 gradients from overflowing in the sum.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    tensor = bucket.buffer()
    tensor.div_(world)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def returns_future(hook: Callable) -> Callable:
    """``hook``, checked to return a ``torch.futures.Future`` (torch raises RuntimeError too)."""
    name = getattr(hook, "__qualname__", None) or repr(hook)

    def checked(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut = hook(state, bucket)
        if not callable(getattr(fut, "wait", None)):  # torch._C.Future or torch.futures.Future
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise LocalUsageError(  # a RuntimeError, as torch's; not blamed on a peer
                f"rank {rank}: DistributedDataParallel: comm hook {name} returned "
                f"{type(fut).__name__}, not a "
                "torch.futures.Future holding the averaged bucket. Return e.g. "
                "dist.all_reduce(t, async_op=True).get_future().then(...), or "
                "lockstep.comm.hooks.completed_future(tensor) when nothing is sent."
            )
        return fut

    checked.__qualname__ = checked.__name__ = getattr(hook, "__name__", "hook")
    return checked


def check_annotations(hook: Callable) -> None:
    """Raise ValueError, as torch's ``register_comm_hook``, for a wrongly annotated ``hook``.

    The bucket parameter may be unannotated, ``Any`` or ``GradBucket`` (lockstep's or torch's); the
    return annotation absent or ``torch.futures.Future[torch.Tensor]``. String annotations (from
    ``from __future__ import annotations``) are compared by name.
    """
    name = getattr(hook, "__qualname__", None) or repr(hook)
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty:
        ann = bucket.annotation
        ok = (ann in (GradBucket, getattr(dist, "GradBucket", GradBucket), Any)
              or (isinstance(ann, str) and ann.split(".")[-1] in ("GradBucket", "Any")))
        if not ok:
            raise ValueError(
                f"register_comm_hook: hook {name}: bucket annotation should be dist.GradBucket "
                f"(or lockstep.GradBucket), got {ann!r}; fix or remove the annotation."
            )
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty:
        ok = (ret == torch.futures.Future[torch.Tensor]
              or (isinstance(ret, str)
                  and ret.replace(" ", "") in ("torch.futures.Future[torch.Tensor]",
                                               "Future[torch.Tensor]", "Future[Tensor]")))
        if not ok:
            raise ValueError(
                f"register_comm_hook: hook {name}: return annotation should be "
                f"torch.futures.Future[torch.Tensor], got {ret!r}; fix or remove the annotation."
            )
