"""A unit's parameters as 1/N shards: the layout, the gather into full tensors, the gradient send.

Every parameter of a unit is flattened, padded with zeros to a multiple of the group size N and
cut into N equal chunks; rank r keeps chunk r as a 1-D ``nn.Parameter`` (the *shard*, the leaf
the optimizer sees under the parameter's own name). The shards of a unit lie side by side in one
flat buffer for communication: one all-gather brings every rank's flat buffer, and each
parameter's full value is read out of it into a persistent *full* tensor whose storage is freed
while the unit is sharded. Autograd saves the full tensors during forward; they are refilled in
place (through ``.data``, which does not bump autograd's version counter) before backward needs
them, which is why they are never replaced, only refilled.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lockstep._torch_compat import tensor_version
from lockstep.fsdp import collectives
from lockstep.fsdp.registry import mark_shard

__all__ = ["FlatShard", "ParamSlot", "shard_shape"]


def shard_shape(ndim: int, chunk: int) -> tuple[int, ...]:
    """The shape of a shard of ``chunk`` elements of an ``ndim``-dimensional parameter: its
    elements in the last dimension, ones before it, so that ``p.dim()`` is the parameter's (a
    matrix's shard is 2-D, a bias's 1-D), as with torch's ``DTensor`` shards. Optimizer groups
    built by dimension (``p.dim() >= 2`` gets weight decay in nanoGPT, ``p.ndim <= 1`` none in
    timm) then split a sharded model as they split the plain one."""
    return (1,) * (ndim - 1) + (chunk,) if ndim > 1 else (chunk,)


@dataclass
class ParamSlot:
    """One original parameter of a unit: where it is used, its shard and its full tensor."""

    fqn: str
    uses: list[tuple[nn.Module, str]]  # every (module, attribute) holding it: ties share a slot
    shape: torch.Size
    numel: int
    chunk: int  # elements per rank
    offset: int  # start of this parameter's chunk in the flat shard
    shard: nn.Parameter
    full: nn.Parameter
    grad_offset: int = -1  # start in the gradient buffer (trainable parameters only)
    unsharded_grad: torch.Tensor | None = field(default=None)  # accumulated without sync


class FlatShard:
    """The shards of a unit's parameters and the full tensors they are gathered into."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        rank: int,
        size: int,
        compute_dtype: torch.dtype,
    ) -> None:
        self.rank, self.size, self.compute_dtype = rank, size, compute_dtype
        self.slots: list[ParamSlot] = []
        # The parameters this unit replaced, weakly (they must be freed), compared by identity.
        self._originals: dict[int, weakref.ref[torch.Tensor]] = {}
        offset = 0
        for fqn, param, uses in params:
            self._originals[id(param)] = weakref.ref(param)
            numel = param.numel()
            chunk = math.ceil(numel / size)
            flat = F.pad(param.detach().reshape(-1), (0, chunk * size - numel))
            shard = nn.Parameter(flat[rank * chunk : (rank + 1) * chunk].clone().view(shard_shape(param.dim(), chunk)),
                                 requires_grad=param.requires_grad)
            mark_shard(shard)  # an optimizer of shards is told from a plain one (checkpoints)
            full = nn.Parameter(torch.empty(param.shape, dtype=compute_dtype, device=param.device),
                                requires_grad=param.requires_grad)
            full.untyped_storage().resize_(0)
            self.slots.append(ParamSlot(fqn, uses, param.shape, numel, chunk, offset, shard, full))
            offset += chunk
        self.shard_numel = offset  # elements of this rank's flat shard
        self.grad_numel = 0
        self._sent: list[ParamSlot] = []  # the trainable slots of the last grad_send, in order
        self.sync_trainable()
        self._complete = True  # whether the last grad_send had every trainable gradient
        self.device = params[0][1].device if params else torch.device("cpu")
        self.shard_dtype = params[0][1].dtype if params else compute_dtype
        self.use_shards()

    def replaced(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the original parameters this unit shards."""
        ref = self._originals.get(id(param))
        return ref is not None and ref() is param

    def originals(self) -> list[torch.Tensor]:
        """The original parameters still alive elsewhere (a sign of sharing between units)."""
        return [p for r in self._originals.values() if (p := r()) is not None]

    @property
    def trainable(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.shard.requires_grad]

    def sync_trainable(self) -> list[ParamSlot]:
        """Follow ``requires_grad`` set on the shards since the last call (a layer frozen or
        unfrozen after ``fully_shard``, as torch's FSDP allows): the full tensors get the same
        flag and the gradient layout is laid out again. Returns the trainable slots."""
        trainable = self.trainable
        grad_offset = 0
        for slot in self.slots:
            wanted = slot.shard.requires_grad
            if slot.full.requires_grad != wanted:
                slot.full.requires_grad_(wanted)
            slot.grad_offset = grad_offset if wanted else -1
            grad_offset += slot.chunk if wanted else 0
            if not wanted:
                slot.unsharded_grad = None  # frozen meanwhile: no gradient of its to reduce
        self.grad_numel = grad_offset
        return trainable

    def check_unchanged(self, owner: str) -> None:
        """Raise if a parameter was replaced or converted since ``fully_shard`` (``model.to()``,
        ``to_empty()``, a new ``nn.Parameter`` assigned): the shards, their dtype and device are
        fixed when the unit is made, so the unit would gather stale shards or fail in forward."""
        for slot in self.slots:
            for module, name in slot.uses:
                held = module._parameters.get(name)
                if held is not slot.shard and held is not slot.full:
                    change = "replaced"
                elif slot.shard.dtype != self.shard_dtype or slot.shard.device != self.device:
                    change = f"converted to {slot.shard.dtype} on {slot.shard.device}"
                else:
                    continue
                raise RuntimeError(
                    f"fully_shard: parameter '{slot.fqn}' of {owner} was {change} after "
                    f"fully_shard (sharded as {self.shard_dtype} on {self.device}): model.to(), "
                    "to_empty() or assigning a new nn.Parameter after fully_shard is not "
                    "supported. Move the model to its device and dtype, and initialise it, "
                    "before fully_shard (docs/fsdp.md, Differences from torch's fully_shard)"
                )

    # -- which tensor the modules see ------------------------------------------------------------

    def use_shards(self) -> None:
        """Register the shards on the modules (what ``parameters()`` and optimizers see)."""
        for slot in self.slots:
            for module, name in slot.uses:
                module._parameters[name] = slot.shard

    def use_full(self) -> None:
        """Register the full tensors on the modules, for their forward."""
        for slot in self.slots:
            for module, name in slot.uses:
                module._parameters[name] = slot.full

    # -- all-gather --------------------------------------------------------------------------

    def gather_input(self) -> torch.Tensor:
        """This rank's flat shard in the compute dtype: what it contributes to the all-gather."""
        if not self.slots:
            return torch.empty(0, dtype=self.compute_dtype, device=self.device)
        return torch.cat([s.shard.detach().reshape(-1).to(self.compute_dtype) for s in self.slots])

    def gather_output(self) -> torch.Tensor:
        return torch.empty(self.size * self.shard_numel, dtype=self.compute_dtype, device=self.device)

    def fill_full(self, gathered: torch.Tensor) -> None:
        """Read every parameter's full value out of the all-gathered flat buffer."""
        rows = gathered.view(self.size, self.shard_numel)
        for slot in self.slots:
            value = rows[:, slot.offset : slot.offset + slot.chunk].reshape(-1)[: slot.numel]
            full = slot.full
            full.untyped_storage().resize_(slot.numel * full.element_size())
            full.data.copy_(value.view(slot.shape))

    def shard_versions(self) -> tuple[int, ...]:
        """The shards' version counters: any in-place change (an optimizer step, an EMA update,
        ``load_state_dict``, a copy into ``parameters()``) moves one."""
        return tuple(tensor_version(s.shard) for s in self.slots)

    def free_full(self) -> None:
        """Release the full tensors' memory; autograd keeps the (empty) tensors it saved."""
        for slot in self.slots:
            slot.full.untyped_storage().resize_(0)

    # -- gradients ---------------------------------------------------------------------------

    def stash_grads(self) -> None:
        """Move the full gradients aside, unreduced (accumulation without communication)."""
        for slot in self.trainable:
            grad = slot.full.grad
            if grad is None:
                continue
            if slot.unsharded_grad is None:
                slot.unsharded_grad = grad.detach().to(slot.shard.dtype)  # the full shape
            else:
                slot.unsharded_grad.add_(grad)
            slot.full.grad = None

    @property
    def reduce_numel(self) -> int:
        """Elements of each rank's reduced row of the last :meth:`grad_send`: its gradient
        chunks, then one flag per gradient."""
        return self.grad_numel + len(self._sent)

    def grad_send(self, dtype: torch.dtype) -> torch.Tensor:
        """The reduce-scatter input: each rank's row holds its chunk of every gradient, ÷ N.

        A gradient this rank did not produce contributes zeros. Division before the sum keeps
        bf16 sums in range and stands in for gloo's missing ``ReduceOp.AVG``. After the chunks
        every row carries one flag per trainable parameter, non-zero where this rank produced a
        gradient: summed by the same reduce-scatter, they tell every rank which parameters got a
        gradient anywhere, so that one used by no rank keeps ``.grad = None``, as in torch.
        """
        trainable = self._sent = self.sync_trainable()
        send = torch.zeros(self.size, self.reduce_numel, dtype=dtype, device=self.device)
        self._complete = True  # every gradient produced here: no flag needs reading back
        for i, slot in enumerate(trainable):
            grad = slot.full.grad
            if slot.unsharded_grad is not None:
                grad = slot.unsharded_grad if grad is None else slot.unsharded_grad + grad
            slot.full.grad = None
            slot.unsharded_grad = None
            if grad is None:
                self._complete = False
                continue
            padded = F.pad(grad.detach().reshape(-1).to(dtype), (0, slot.chunk * self.size - slot.numel))
            send[:, slot.grad_offset : slot.grad_offset + slot.chunk] = padded.view(self.size, slot.chunk)
            send[:, self.grad_numel + i] = 1
        return send.div_(self.size)

    def set_shard_grads(self, reduced: torch.Tensor) -> None:
        """Accumulate this rank's reduced chunk of every gradient into the shards' ``.grad``.

        A parameter whose flag is zero got a gradient on no rank: its ``.grad`` is left as it is
        (``None`` after ``zero_grad``), not set to zeros that weight decay would act on.
        """
        # Reading the flags waits for the device; when this rank produced every gradient, every
        # flag is set and the read is skipped.
        sent = self._sent  # the layout the reduction was sent in
        got = [True] * len(sent) if self._complete else (reduced[self.grad_numel :] != 0).tolist()
        for slot, produced in zip(sent, got):
            if not produced:
                continue
            piece = reduced[slot.grad_offset : slot.grad_offset + slot.chunk].to(slot.shard.dtype)
            piece = piece.view(slot.shard.shape)
            if slot.shard.grad is None:
                slot.shard.grad = piece.clone()
            else:
                slot.shard.grad.add_(piece)

    # -- whole values (state dicts) -----------------------------------------------------------

    def gather_full_values(self, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Every parameter's full value in the shards' own dtype, in slot order (a collective)."""
        if not self.slots:
            return []
        local = torch.cat([s.shard.detach().reshape(-1) for s in self.slots])
        out = local.new_empty(self.size * self.shard_numel)
        collectives.all_gather_into_tensor(out, local, group).wait()
        rows = out.view(self.size, self.shard_numel)
        return [
            rows[:, s.offset : s.offset + s.chunk].reshape(-1)[: s.numel].view(s.shape)
            for s in self.slots
        ]

    def use_tensors(self, values: list[torch.Tensor]) -> None:
        """Register ``values`` (one per slot) on the modules in place of the shards."""
        for slot, value in zip(self.slots, values):
            for module, name in slot.uses:
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
