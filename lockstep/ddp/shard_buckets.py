"""The fixed-tree reduction of virtual shards, bucket by bucket, overlapped with the last backward.

Addition is element by element, so cutting the flat gradient into buckets changes no bit: each
bucket is summed over the rank's shards in the tree order (:class:`TreeSum`), then across ranks
by :func:`lockstep.ddp.shard_tree.combine_subtrees`'s all-to-all, tree sum and all-gather. What
buckets buy is time: during the rank's last shard's backward, a bucket's all-to-all starts as
soon as its gradients exist. Buckets start strictly in bucket order (bucket ``k`` waits for
``0..k-1``), so every rank issues the same collectives in the same order even when a shard's
graph leaves some parameters without a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.shard_tree import TreeSum, tree_sum
from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress

__all__ = ["ShardBuckets"]


_EXCHANGE = "VirtualShardDDP gradient exchange (all-to-all)"
_GATHER = "VirtualShardDDP gradient all-gather"


class ShardBuckets:
    """Per-bucket tree sums of one step's shard gradients, reduced across ranks as they finish.

    Args:
        params: the parameters with gradients, one dtype and device.
        bucket_elements: elements per bucket (buckets hold whole parameters, in reverse order,
            the order backward produces them).
        world_size, group: the ranks that share the work.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_elements: int,
                 world_size: int, group: Any = None) -> None:
        self.params, self.world_size, self.group = list(params), world_size, group
        self.buckets: list[list[int]] = []
        size = bucket_elements
        for index in reversed(range(len(self.params))):
            if size >= bucket_elements:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(index)
            size += self.params[index].numel()
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}

    def begin(self) -> None:
        """Start a step."""
        self._sums = [TreeSum() for _ in self.buckets]
        self._last: dict[int, torch.Tensor] = {}
        self._launched: list[tuple[torch.Tensor, Any, int, int]] = []

    def push(self, grads: Sequence[torch.Tensor]) -> None:
        """Add a whole shard's gradients (every shard but the rank's last)."""
        for b, members in enumerate(self.buckets):
            self._sums[b].push(torch.cat([grads[i].reshape(-1) for i in members]))

    def hooks(self) -> list[Any]:
        """Hooks that collect the last shard's gradients and launch finished buckets; remove
        them after that shard's backward."""
        return [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, index: int) -> Any:
        def collect(grad: torch.Tensor) -> None:
            self._last[index] = grad
            self._launch_ready()

        return collect

    def _launch_ready(self, force: bool = False) -> None:
        while len(self._launched) < len(self.buckets):
            b = len(self._launched)
            members = self.buckets[b]
            if not force and any(i not in self._last for i in members):
                return
            parts = [self._last.get(i, torch.zeros_like(self.params[i])).reshape(-1)
                     for i in members]
            self._sums[b].push(torch.cat(parts))
            self._launch(self._sums[b].result())

    def _launch(self, local: torch.Tensor) -> None:
        n = local.numel()
        chunk = -(-n // self.world_size)
        send = local.new_zeros(chunk * self.world_size)
        send[:n] = local
        received = torch.empty_like(send)
        progress = group_progress(self.group)
        seq = progress.enter(_EXCHANGE)
        work = hang.call_as(progress, seq, _EXCHANGE, lambda: dist.all_to_all_single(
            received, send, group=self.group, async_op=True))
        self._launched.append((received, (seq, work), chunk, n))

    def finish(self, scale: float) -> None:
        """Launch what backward left, finish every bucket, and set each ``.grad`` (times
        ``scale``)."""
        self._launch_ready(force=True)
        gathers = []
        progress = group_progress(self.group)
        for received, (seq, work), chunk, n in self._launched:
            hang.wait(progress, seq, _EXCHANGE, work)
            mine = tree_sum(list(received.view(self.world_size, chunk).unbind(0)))
            out = torch.empty_like(received)
            parts = list(out.view(self.world_size, chunk).unbind(0))
            at = progress.enter(_GATHER)
            handle = hang.call_as(progress, at, _GATHER, lambda: dist.all_gather(
                parts, mine, group=self.group, async_op=True))  # noqa: B023 - called at once
            gathers.append((out, (at, handle), n))
        for (out, (at, handle), n), members in zip(gathers, self.buckets):
            hang.wait(progress, at, _GATHER, handle)
            flat, offset = out[:n] * scale, 0
            for i in members:
                p = self.params[i]
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._last.clear()
