"""One pipeline stage at work: forward and backward of its module, one micro-batch at a time.

A stage's forward keeps what its backward needs (its inputs, outputs, and autograd's saved
tensors) until that micro-batch's backward; the schedule decides how many are alive at once.
Tensors cross a stage boundary detached, so each stage's graph ends at its own inputs and the
gradient of those inputs is what goes back to the stage before.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StageRunner", "StageStats", "as_tensor_tuple"]

# Errors that say a layer got a tensor of the wrong shape (a stage boundary in the wrong place).
_SHAPE_ERROR = re.compile(r"shape|size|cannot be multiplied|dimension|mat1|mat2", re.IGNORECASE)
# torch's error for an in-place operation on a stage input (a leaf that requires grad).
_IN_PLACE_ERROR = re.compile(r"leaf Variable that requires grad .* in-place operation")


def as_tensor_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors: a stage may take or return one tensor or a tuple of them.

    Raises:
        TypeError: ``value`` holds something other than tensors, naming ``what`` it is.
    """
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if not torch.is_tensor(item):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors to cross a stage boundary, "
                f"got {type(item).__name__}"
            )
    return tuple(items)


@dataclass
class StageStats:
    """What one stage measured during the last step.

    Attributes:
        activation_bytes: bytes kept for backward per micro-batch (saved tensors, inputs and
            outputs, parameters excluded), by micro-batch index.
        peak_activation_bytes: the most bytes kept at once.
        peak_sent_bytes: with one stage per rank, the most bytes of sent activations and
            gradients held at once until the neighbour had taken them.
        events: ``(action, start, end)`` per action, in ``time.perf_counter`` seconds (host
            time: on CUDA it is when work was queued, unless the device is synchronised).
    """

    activation_bytes: dict[int, int] = field(default_factory=dict)
    peak_activation_bytes: int = 0
    peak_sent_bytes: int = 0
    events: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def busy_s(self) -> float:
        """Seconds spent computing (forwards and backwards, not waiting or sending)."""
        return sum(end - start for _, start, end in self.events)


class _SavedBytes:
    """Counts distinct storages autograd saves during a forward, parameters excluded."""

    def __init__(self, module: nn.Module) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.sizes: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().data_ptr() in self._skip:
            return
        # Keyed by where the tensor's data starts: a tensor saved twice, or an input that is
        # also saved, counts once; a micro-batch slice of the batch counts its own bytes only.
        nbytes = tensor.numel() * tensor.element_size()
        self.sizes[tensor.data_ptr()] = max(nbytes, self.sizes.get(tensor.data_ptr(), 0))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


class StageRunner:
    """Runs micro-batches through one stage module and back, and measures it.

    Args:
        module: the stage (already on ``device``).
        index: the stage's position in the pipeline.
        num_stages: how many stages the pipeline has.
        device: where the stage's inputs must be.
        loss_fn: on the last stage, ``loss_fn(output, target)`` giving the micro-batch's mean loss.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.stats = StageStats()
        self._live_bytes = 0
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._first_layer_in_place = _first_layer_in_place(module)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        target: Any = None,
        loss_scale: float = 1.0,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """Run ``microbatch`` forward; keep what backward needs when gradients are on.

        Returns:
            The outputs, detached (what goes to the next stage), and on the last stage with a
            ``loss_fn`` the micro-batch's loss (unscaled, detached), else ``None``.
        """
        start = time.perf_counter()
        training = torch.is_grad_enabled()
        given = inputs
        if training and not self.is_first:
            # The stage's graph starts here: the gradient of these is what goes back.
            inputs = tuple(
                t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in inputs
            )
            given = inputs
            if self._first_layer_in_place:
                # A layer working in place cannot write into a leaf that requires grad: give
                # it a copy (a non-leaf whose gradient flows back to the leaf).
                given = tuple(t.clone() if t.requires_grad else t for t in inputs)
        counter = _SavedBytes(self.module)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            outputs = as_tensor_tuple(self._call_module(microbatch, given),
                                      f"pipeline stage {self.index}'s output")
        if self.is_last:
            for position, t in enumerate(outputs):
                if t.dim() == 0:
                    raise ValueError(
                        f"pipeline stage {self.index} (the last) returned a 0-dim tensor as output "
                        f"{position}: the last stage's outputs are joined along dimension 0 over "
                        "the micro-batches, so each needs a batch dimension. Return it with one "
                        "(e.g. aux.reshape(1), one value per micro-batch), or compute it in "
                        "loss_fn")
        loss = None
        if training and self.is_last and self.loss_fn is not None:
            loss = self._loss(outputs, target)
        if training:
            for t in inputs + outputs:
                counter.add(t)
            self._keep(microbatch, inputs, outputs, loss, loss_scale, counter.total)
        self.stats.events.append((f"F{microbatch}", start, time.perf_counter()))
        detached = tuple(t.detach() for t in outputs)
        return detached, (loss.detach() if loss is not None else None)

    def backward(
        self, microbatch: int, grad_outputs: tuple[torch.Tensor, ...] | None
    ) -> tuple[torch.Tensor, ...]:
        """Run ``microbatch`` backward from the loss (last stage) or from ``grad_outputs``.

        ``grad_outputs`` holds one gradient per floating-point output, in order.

        Returns:
            One gradient per floating-point input, in order (zeros where an input was unused);
            none on the first stage.
        """
        start = time.perf_counter()
        if microbatch not in self._inputs:
            raise RuntimeError(
                f"stage {self.index} was asked for B{microbatch} before F{microbatch} ran with "
                "gradients on: run training steps outside torch.no_grad()"
            )
        inputs = self._inputs.pop(microbatch)
        outputs = self._outputs.pop(microbatch)
        if self.is_last and self.loss_fn is not None:
            self._losses.pop(microbatch).backward()
        else:
            self._backward_from(microbatch, outputs, grad_outputs)
        self._live_bytes -= self.stats.activation_bytes[microbatch]
        # The first stage's inputs are the user's batch (views of it): nothing goes back, and
        # reading .grad of those views would only warn (a batch that requires grad gets its
        # gradient through them, as from one backward over the whole batch).
        grads = () if self.is_first else tuple(
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in inputs
            if t.requires_grad
        )
        self.stats.events.append((f"B{microbatch}", start, time.perf_counter()))
        return grads

    def grad_slots(self, microbatch: int) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of each gradient the next stage will send back for ``microbatch``."""
        return [(t.shape, t.dtype) for t in self._outputs[microbatch] if _is_float(t)]

    def _call_module(self, microbatch: int, inputs: tuple[torch.Tensor, ...]) -> Any:
        try:
            return self.module(*inputs)
        except Exception as exc:
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            source = "the batch" if self.is_first else f"stage {self.index - 1}"
            hint = (f" If these shapes are not what stage {self.index}'s first layer takes, the "
                    "stage boundary is wrong: check the stage split (balance) and the layer sizes "
                    "on both sides." if _SHAPE_ERROR.search(str(exc)) else "")
            if _IN_PLACE_ERROR.search(str(exc)):
                hint = (f" A layer of stage {self.index} writes in place into the stage's input, "
                        "which the pipeline makes a leaf that requires grad: use inplace=False "
                        "for that layer, or move the cut (balance=[...]) so that it is not right "
                        "after one.")
            raise RuntimeError(
                f"pipeline stage {self.index} failed in forward on micro-batch {microbatch} with "
                f"inputs of shapes [{shapes}] from {source}: {type(exc).__name__}: {exc}.{hint}"
            ) from exc

    def _loss(self, outputs: tuple[torch.Tensor, ...], target: Any) -> torch.Tensor:
        output = outputs[0] if len(outputs) == 1 else outputs
        loss_fn = self.loss_fn
        if loss_fn is None:
            raise RuntimeError(f"stage {self.index} has no loss_fn to compute a loss with")
        try:
            loss = loss_fn(output) if target is None else loss_fn(output, target)
        except Exception as exc:
            got = ", ".join(str(tuple(t.shape)) for t in outputs)
            wanted = f" and a target of shape {tuple(target.shape)}" if torch.is_tensor(target) else ""
            raise RuntimeError(
                f"pipeline stage {self.index} (the last): loss_fn failed on outputs of shapes "
                f"[{got}]{wanted}: {type(exc).__name__}: {exc}. The target is cut into "
                "micro-batches like the input: give it the batch's samples along dimension 0."
            ) from exc
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(
                "loss_fn must return a single-element tensor (the micro-batch's mean loss), "
                f"got {loss if not torch.is_tensor(loss) else tuple(loss.shape)}"
            )
        return loss.reshape(())

    def _keep(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        loss: torch.Tensor | None,
        loss_scale: float,
        nbytes: int,
    ) -> None:
        self._inputs[microbatch] = inputs
        self._outputs[microbatch] = outputs
        if loss is not None:
            # Scaled by the micro-batch's share of the batch, so the summed gradients are those
            # of the mean loss over the whole batch.
            self._losses[microbatch] = loss * loss_scale
        self.stats.activation_bytes[microbatch] = nbytes
        self._live_bytes += nbytes
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self._live_bytes)

    def _backward_from(
        self,
        microbatch: int,
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...] | None,
    ) -> None:
        floats = [t for t in outputs if _is_float(t)]
        grads = list(grad_outputs or ())
        if len(grads) != len(floats):
            raise RuntimeError(
                f"stage {self.index} got {len(grads)} gradients for micro-batch {microbatch}, "
                f"but it has {len(floats)} floating-point outputs"
            )
        pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _first_layer_in_place(module: nn.Module) -> bool:
    """Whether the first layer of a sequential stage works in place (``ReLU(inplace=True)``)."""
    while True:
        inner = getattr(module, "module", None)  # a data-parallel wrapper's module
        if isinstance(inner, nn.Module):
            module = inner
        elif isinstance(module, nn.Sequential) and len(module) > 0:
            module = module[0]
        else:
            break
    return bool(getattr(module, "inplace", False))


def _is_float(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()
