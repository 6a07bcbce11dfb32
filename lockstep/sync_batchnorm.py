"""SyncBatchNorm: batch normalisation whose statistics cover the batch of every rank.

With data parallelism each rank sees a slice of the batch; plain BatchNorm normalises by that
slice's statistics, which is noisy for small per-rank batches (detection, segmentation). Here
the forward all-reduces each channel's sum, sum of squares and count, and the backward
all-reduces the two per-channel sums the input gradient needs, so the result equals BatchNorm
over the whole global batch in one process. Weight and bias gradients stay local: DDP averages
them like every other gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from lockstep._torch_compat import BatchNormBase
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``x`` (N, C, ...)."""
    return t.view([1, -1] + [1] * (x.dim() - 2))


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        hang.run(group_progress(group), "SyncBatchNorm gradient all-reduce",
                 lambda: dist.all_reduce(t, group=group))


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``t``, stacked in group order (just ``t`` without a group)."""
    if group is None:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    hang.run(group_progress(group), "SyncBatchNorm statistics all-gather",
             lambda: dist.all_gather(parts, t, group=group))
    return torch.stack(parts)


def _check_channels(channels: int, group: dist.ProcessGroup) -> None:
    """Raise on every rank of ``group`` when its ranks built SyncBatchNorm for different C.

    Their statistics would otherwise be gathered in messages of different sizes, which gloo
    answers by aborting one rank and handing another a partly filled buffer.
    """
    every = _all_gather(torch.tensor([channels], dtype=torch.int64), group)
    counts = [int(c) for c in every.flatten().tolist()]
    if len(set(counts)) > 1:
        ranks = dist.get_process_group_ranks(group)
        listed = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
        raise ValueError(
            f"SyncBatchNorm: the ranks built this layer for different numbers of channels "
            f"({listed}); every rank must build the same model"
        )


def _check_dtypes(x: torch.Tensor, tensors: list[torch.Tensor | None]) -> None:
    """Refuse what ``F.batch_norm`` refuses: parameters or running statistics of another dtype
    than the input, unless the input is float16/bfloat16 and they are float32."""
    kinds = {t.dtype for t in tensors if t is not None}
    if not kinds or kinds == {x.dtype}:
        return
    if x.dtype in (torch.float16, torch.bfloat16) and kinds == {torch.float32}:
        return
    raise RuntimeError(
        f"SyncBatchNorm: mixed dtype: the input is {x.dtype} but the layer's parameters or "
        f"running statistics are {sorted(str(k) for k in kinds)}; as BatchNorm, it needs them "
        "alike (or a float16/bfloat16 input with float32 ones): convert the model or the input"
    )


def _global_stats(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance per channel over every rank's batch, and the total count.

    Each rank sends its count, mean and variance around its *own* mean; they are combined in
    float64 as parallel variance is (Chan et al.): the spread of the ranks' means around the
    global mean is added to their variances, so nothing is ever subtracted from a raw sum of
    squares, and a large mean cannot cancel the variance away (torch gathers the same three).
    """
    count = x.numel() // x.size(1)
    channels = x.size(1)
    packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
    if count > 0:
        var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
        packed[:channels] = mean.double()
        packed[channels:-1] = var.double()
        packed[-1] = count
    every = _all_gather(packed, group)
    counts = every[:, -1:]
    total = int(counts.sum().item())
    if total == 0:
        zeros = torch.zeros(channels, dtype=x.dtype, device=x.device)
        return zeros, zeros.clone(), 0
    mean = (every[:, :channels] * counts).sum(0) / total
    spread = every[:, channels:-1] + (every[:, :channels] - mean).square()
    var = (spread * counts).sum(0) / total
    return mean.to(x.dtype), var.to(x.dtype), total


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, with mean and var over all ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var, total = _global_stats(x, group)
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel over all ranks when "
                f"training, got {total} (input shape on this rank {tuple(x.shape)}); "
                "use a larger batch or call .eval()"
            )
        invstd = torch.rsqrt(var + eps)
        x_hat = (x - _channel_view(mean, x)) * _channel_view(invstd, x)
        y = x_hat
        if weight is not None:
            y = y * _channel_view(weight.to(x.dtype), x)
        if bias is not None:  # none with affine=False, or a torch 2.13 BatchNorm(bias=False)
            y = y + _channel_view(bias.to(x.dtype), x)
        ctx.save_for_backward(x_hat, invstd, weight)  # type: ignore[arg-type]  # None allowed
        ctx.group, ctx.total = group, total  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        count = torch.tensor(total, device=x.device)
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_y: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor | None, ...]:
        x_hat, invstd, weight = ctx.saved_tensors
        dims = _reduce_dims(x_hat)
        # The two local sums below are the only per-channel quantities the input gradient needs
        # from other ranks; weight and bias gradients are their local values (DDP averages).
        sum_dy = grad_y.sum(dims)
        sum_dy_xhat = (grad_y * x_hat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:  # only the input's gradient needs the other ranks' sums
            packed = torch.cat([sum_dy, sum_dy_xhat]).double()
            _all_reduce(packed, ctx.group)
            channels = sum_dy.numel()
            mean_dy = (packed[:channels] / ctx.total).to(x_hat.dtype)
            mean_dy_xhat = (packed[channels:] / ctx.total).to(x_hat.dtype)
            scale = invstd if weight is None else invstd * weight.to(x_hat.dtype)
            centred = (
                grad_y
                - _channel_view(mean_dy, x_hat)
                - x_hat * _channel_view(mean_dy_xhat, x_hat)
            )
            grad_x = centred * _channel_view(scale, x_hat)
        grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(BatchNormBase):
    """BatchNorm over the global batch: statistics are summed over the ranks of a group.

    Same arguments and state dict as ``torch.nn.SyncBatchNorm`` and the ``BatchNorm*d``
    classes; accepts inputs of 2 or more dimensions (N, C, ...). In eval mode it uses the running
    statistics and communicates nothing; in a world of one (or with no process group) it
    never communicates.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance for stability.
        momentum: weight of the new batch in the running statistics (``None``: cumulative mean).
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance for eval.
        process_group: the ranks to share statistics with; ``None`` means the default group.
        bias: with ``affine``, learn a bias too (``False``: a weight alone; torch 2.13's).

    Example::

        model = lockstep.SyncBatchNorm.convert_sync_batchnorm(model)
        ddp = lockstep.DistributedDataParallel(model)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        # Only a torch whose BatchNorm has ``bias=`` (2.13) is given it, so older ones still work.
        extra = {} if bias else {"bias": False}
        try:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device,
                             dtype, **extra)
        except TypeError as err:
            if extra and "bias" in str(err):
                raise TypeError(
                    f"SyncBatchNorm(bias=False) needs a torch whose BatchNorm takes bias=; torch "
                    f"{torch.__version__} does not: upgrade torch, or use bias=True") from err
            raise
        self.process_group = process_group
        self._channels_checked: set[int] = set()  # ids of groups whose ranks agreed on C

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}-D "
                f"input of shape {tuple(input.shape)}"
            )
        if input.size(1) == 0:  # torch's message and type
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm was built for {self.num_features} channels, but the input has "
                f"{input.size(1)} in dimension 1 (shape {tuple(input.shape)})"
            )

    def _group(self) -> dist.ProcessGroup | None:
        """The group to reduce over, or None when there is no one to talk to."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:
            return torch.nn.functional.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias,
                False, 0.0, self.eps,
            )
        # Only training synchronises: evaluation (even without running statistics) stays
        # local, so one rank may evaluate alone without hanging the others.
        group = self._group() if self.training else None
        if group is None:
            # Nobody to talk to: plain batch norm, as torch's class does (so a world of one
            # gives torch's own values, and double backward works).
            return self._local_batch_norm(input)
        _check_dtypes(input, [self.weight, self.bias, self.running_mean, self.running_var])
        checked = self.__dict__.setdefault("_channels_checked", set())
        if id(group) not in checked:  # once per group: one small all-gather
            _check_channels(self.num_features, group)
            checked.add(id(group))
        # Statistics in float32 even under autocast: bf16 sums over a batch lose too much.
        with torch.autocast(device_type=input.device.type, enabled=False):
            work = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
            y, mean, var, count = _SyncBatchNormFunction.apply(
                work, self.weight, self.bias, self.eps, group
            )
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, int(count.item()))
        return y.to(input.dtype)

    def _local_batch_norm(self, input: torch.Tensor) -> torch.Tensor:
        """Batch statistics of this rank's input only, with BatchNorm's running averages."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.training and self.track_running_stats
        return torch.nn.functional.batch_norm(
            input, self.running_mean if track else None, self.running_var if track else None,
            self.weight, self.bias, True, factor, self.eps,
        )

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """Exponential (or, with momentum None, cumulative) averages, as BatchNorm keeps them."""
        tracked, running_mean, running_var = (
            self.num_batches_tracked, self.running_mean, self.running_var)
        assert tracked is not None and running_mean is not None and running_var is not None
        tracked.add_(1)
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1))
        running_mean.lerp_(mean.to(running_mean.dtype), factor)
        running_var.lerp_(unbiased.to(running_var.dtype), factor)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a SyncBatchNorm with the same state.

        Returns the new module when ``module`` itself is a BatchNorm, else ``module`` changed
        in place (and returned).

        Example::

            model = lockstep.SyncBatchNorm.convert_sync_batchnorm(model)
        """
        converted = module
        # Every BatchNorm, a SyncBatchNorm too: converting again moves it to ``process_group``.
        if isinstance(module, BatchNormBase):
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats, process_group,
                bias=not module.affine or getattr(module, "bias", None) is not None,
            )
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
