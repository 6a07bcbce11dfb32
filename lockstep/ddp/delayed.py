"""torch's ``delay_all_reduce_named_params``: some gradients averaged later, in one all-reduce.

The named parameters leave DDP's buckets. Their gradients live in one flat buffer (each
``.grad`` a view of it); when the gradient of ``param_to_hook_all_reduce`` is computed, the
whole buffer is averaged by one asynchronous all-reduce, and backward waits for it before it
returns. Pick as the hook a parameter whose gradient comes after the delayed ones' (an early
layer), as with torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep._torch_compat import queue_callback

__all__ = ["DelayedAllReduce", "hook_param_name", "split_delayed"]


def split_delayed(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    delayed: Sequence[tuple[str, torch.nn.Parameter]] | None,
    hook_param: torch.nn.Parameter | None,
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[torch.nn.Parameter]]:
    """(parameters left for the buckets, parameters delayed), checking torch's rules.

    Raises:
        ValueError: only one of the two arguments given, or a delayed name/parameter that is
            not one of the module's.
    """
    if (delayed is None) != (hook_param is None):
        raise ValueError(
            "DistributedDataParallel: delay_all_reduce_named_params and "
            "param_to_hook_all_reduce go together: give both or neither."
        )
    if delayed is None:
        return list(named_params), []
    by_name = dict(named_params)
    names = set()
    for name, param in delayed:
        if by_name.get(name) is not param:
            raise ValueError(
                f"DistributedDataParallel: delay_all_reduce_named_params names {name!r}, which "
                "is not a trainable parameter of the module under that name; pass pairs from "
                "module.named_parameters()."
            )
        names.add(name)
    kept = [(n, p) for n, p in named_params if n not in names]
    return kept, [p for _, p in delayed]


def hook_param_name(module: torch.nn.Module, param: torch.nn.Parameter | None) -> str:
    """The name of ``param`` in ``module`` ("" for None).

    Raises:
        ValueError: ``param`` is not one of the module's parameters.
    """
    if param is None:
        return ""
    for name, p in module.named_parameters():
        if p is param:
            return name
    raise ValueError(
        "DistributedDataParallel: param_to_hook_all_reduce is not a parameter of the module; "
        "pass one of module.parameters() (typically of an early layer, whose gradient comes last)."
    )


class DelayedAllReduce:
    """One flat buffer for the delayed parameters' gradients, averaged when ``hook_param``'s is.

    Args:
        params: the delayed parameters (one dtype, one device).
        hook_param: the parameter whose gradient starts the all-reduce.
        group: the process group to average over.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        hook_param: torch.nn.Parameter,
        group: dist.ProcessGroup,
    ) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(
                "DistributedDataParallel: delay_all_reduce_named_params must share one dtype "
                f"and device (they share one flat buffer), got {sorted(map(str, kinds))}"
            )
        self.params = list(params)
        self.group = group
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype,
                                  device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.armed = False
        self._handle = hook_param.register_hook(self._on_hook_grad)

    def before_forward(self, sync: bool) -> None:
        """Point every delayed ``.grad`` at its slot (keeping its value); arm for this backward."""
        for p, view in zip(self.params, self.views):
            if p.grad is view:
                continue
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view
        self.armed = sync

    def _on_hook_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.armed or dist.get_world_size(self.group) == 1:
            return grad
        self.armed = False
        self.buffer.div_(dist.get_world_size(self.group))
        work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
        # torch leaves this all-reduce in flight; waiting at the end of backward means the
        # optimizer never reads a half-reduced gradient.
        queue_callback(work.wait)
        return grad

    def remove(self) -> None:
        self._handle.remove()
