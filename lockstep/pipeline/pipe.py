"""``Pipeline``: a model split into stages that run micro-batches in a pipelined schedule.

Where data parallelism copies the whole model to every device and splits the batch, pipeline
parallelism splits the model: stage ``s`` holds consecutive layers, and micro-batches flow from
stage to stage. Stages live on several devices of this process (``devices=[...]``) or on the
ranks of a process group (one stage per rank, activations sent with point-to-point messages).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.diagnose import hang
from lockstep.diagnose.progress import group_progress
from lockstep.pipeline.checkpoint import StageOptimizerState, load_stage_state, stage_state
from lockstep.pipeline.local import run_local
from lockstep.pipeline.partition import (
    Balance,
    shared_across_stages,
    split_layers,
    stage_sizes,
)
from lockstep.pipeline.ranks import StagePeers, run_rank
from lockstep.pipeline.schedule import Schedule, forward_only, get_schedule
from lockstep.pipeline.stage import StageRunner, StageStats, as_tensor_tuple
from lockstep.shards import mark_stage_param

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline(nn.Module):
    """Split ``module`` into stages and train it on micro-batches with GPipe or 1F1B.

    Args:
        module: an ``nn.Sequential`` to split, or a list of stage modules used as given.
        chunks: number of micro-batches each batch is cut into (along dimension 0).
        schedule: ``"1f1b"`` (activation memory bounded by the number of stages) or ``"gpipe"``.
        loss_fn: ``loss_fn(output, target)`` returning a micro-batch's mean loss; with it
            :meth:`step` trains, without it :meth:`step` only runs forward.
        devices: one device per stage: every stage lives in this process.
        process_group: without ``devices``, the ranks of this pipeline, group rank ``s`` holding
            stage ``s`` (``None``: the default group).
        balance: ``"params"``, ``"time"`` (needs ``sample_input``) or layers per stage, e.g.
            ``[2, 3]``; ignored for a list of stages.
        sample_input: a batch for ``balance="time"``.
        device: with ``process_group``, this rank's device (default: CUDA ``LOCAL_RANK`` with
            NCCL, else the CPU).

    Example::

        pipe = lockstep.Pipeline(nn.Sequential(...), chunks=4, devices=["cuda:0", "cuda:1"],
                                 loss_fn=nn.functional.cross_entropy)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            pipe.step(x, target=y)   # forward and backward of all micro-batches
            opt.step()
    """

    def __init__(
        self,
        module: nn.Sequential | Sequence[nn.Module],
        chunks: int = 1,
        *,
        schedule: str = "1f1b",
        loss_fn: Callable[..., torch.Tensor] | None = None,
        devices: Sequence[torch.device | str] | None = None,
        process_group: dist.ProcessGroup | None = None,
        balance: Balance = "params",
        sample_input: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(chunks, int) or isinstance(chunks, bool):
            raise TypeError(f"chunks must be an int (micro-batches per batch), got {chunks!r}")
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        get_schedule(schedule, 1, 1)  # fail on an unknown name now, not at the first step
        self.chunks = chunks
        self.schedule_name = schedule.lower()
        self.loss_fn = loss_fn
        self.process_group = process_group
        self._local = devices is not None
        if devices is not None:
            self.devices = [torch.device(d) for d in devices]
            self.num_stages = len(self.devices)
            self.stage_indices = list(range(self.num_stages))
            stages = split_layers(module, self.num_stages, balance, sample_input)
            shared = shared_across_stages(stages)
            if shared is not None and self.devices[shared[1]] != self.devices[shared[3]]:
                raise ValueError(_shared_message(
                    shared, f"on devices {self.devices[shared[1]]} and {self.devices[shared[3]]}, "
                    "and moving each stage to its device would move the one parameter twice"))
        else:
            stages = [self._init_distributed(module, balance, sample_input, device)]
        self.stages = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices))
        logger.debug(
            "pipeline of %d stages, %s schedule, %d micro-batches; this process holds stages %s "
            "on %s", self.num_stages, self.schedule_name, chunks, self.stage_indices, self.devices
        )

    def _init_distributed(
        self, module: Any, balance: Balance, sample: Any, device: torch.device | str | None
    ) -> nn.Module:
        """Set up this rank's place in the pipeline group and return its stage."""
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline without devices= places one stage per rank and needs a process group: "
                "call lockstep.init_distributed() first, or pass devices=[...] for one process"
            )
        group = self.process_group
        self.num_stages = dist.get_world_size(group)
        index = dist.get_rank(group)
        if device is None:
            from lockstep.distributed import current_process_info

            device = current_process_info().device
        self.devices = [torch.device(device)]
        self.stage_indices = [index]
        if balance == "time" and isinstance(module, nn.Sequential):
            # Timings differ from rank to rank; every rank must cut at the same places.
            balance = self._agreed_time_balance(module, sample, group)
        stages = split_layers(module, self.num_stages, balance, sample)
        shared = shared_across_stages(stages)
        if shared is not None:  # every rank builds the same model, so every rank refuses
            raise ValueError(_shared_message(
                shared, "on different ranks, where each would train its own copy and the tie "
                "would silently come undone"))
        stage = stages[index]
        for param in stage.parameters():
            mark_stage_param(param, index)  # this rank's own: see pipeline.checkpoint
        return stage

    def _agreed_time_balance(
        self, module: nn.Sequential, sample: Any, group: dist.ProcessGroup | None
    ) -> list[int]:
        """Rank 0 of the group times the layers; every rank gets its split (or its error)."""
        layers = list(module.children())
        if sample is None or self.num_stages > len(layers):
            return stage_sizes(layers, self.num_stages, "time", sample)  # raises on every rank
        answer: list[Any] = [None]
        if dist.get_rank(group) == 0:
            try:
                answer = [stage_sizes(layers, self.num_stages, "time", sample)]
            except Exception as exc:  # noqa: BLE001 - sent to the other ranks, re-raised there
                answer = [f"{type(exc).__name__}: {exc}"]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        hang.run(group_progress(group), "Pipeline balance='time' split from rank 0",
                 lambda: dist.broadcast_object_list(answer, src=src, group=group))
        if isinstance(answer[0], str):
            raise RuntimeError(  # noqa: TRY004 - a remote failure, not a type error
                f"rank {src} failed timing the layers for balance='time': "
                               f"{answer[0]}")
        return answer[0]

    @property
    def is_distributed(self) -> bool:
        """True when each rank of a process group holds one stage, False with ``devices=``."""
        return not self._local

    @property
    def stage(self) -> nn.Module:
        """This rank's stage module (distributed); assign to it to wrap it, e.g. in DDP."""
        if len(self.stages) != 1:
            raise RuntimeError(f"this Pipeline holds {len(self.stages)} stages; use .stages[i]")
        return self.stages[0]

    @stage.setter
    def stage(self, module: nn.Module) -> None:
        if len(self.stages) != 1:
            raise RuntimeError(f"this Pipeline holds {len(self.stages)} stages; set .stages[i]")
        self.stages[0] = module

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module files a module under its own name before a property setter could run.
        if name == "stage":
            Pipeline.stage.fset(self, value)  # type: ignore[attr-defined]
            return
        super().__setattr__(name, value)

    # ---- checkpoints (lockstep.Checkpointer's sharded protocol) --------------------------
    @property
    def save_sharded(self) -> bool:
        """Whether a Checkpointer saves one piece per rank: with one stage per rank, yes."""
        return self.is_distributed

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's piece for a Checkpointer: its stage's weights, tagged with the stage."""
        return stage_state(self.stage_indices[0], self.num_stages, self.stages[0])

    def load_sharded_state_dict(self, pieces: Sequence[Any]) -> None:
        """Load the weights this rank's stage saved (any rank's piece of the same stage)."""
        load_stage_state(pieces, self.stage_indices[0], self.num_stages, self.stages[0])

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> StageOptimizerState | Any:
        """What to pass a Checkpointer for ``optimizer``, which steps this rank's stage.

        With one stage per rank each rank's optimizer state is its own, saved and restored per
        rank: ``ckpt.save(step, model=pipe, optimizer=pipe.optimizer_state(optimizer))``. With
        every stage in this process the optimizer is returned as it is.
        """
        if not self.is_distributed:
            return optimizer
        return StageOptimizerState(self.stage_indices[0], self.num_stages, optimizer)

    def schedule(self, training: bool = True) -> Schedule:
        """The action lists of this pipeline's schedule, one per stage (print it to see it)."""
        if not training:
            return forward_only(self.num_stages, self.chunks)
        return get_schedule(self.schedule_name, self.num_stages, self.chunks)

    @property
    def stats(self) -> list[StageStats]:
        """What each stage held by this process measured during the last step."""
        return [runner.stats for runner in getattr(self, "_runners", [])]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of every stage by the norm of the whole model's gradients.

        With one stage per rank, torch's ``clip_grad_norm_(pipe.parameters())`` sees this rank's
        stage only and would clip each stage by its own norm. This sums the stages' ``p``-th
        powers (the maximum for ``inf``) with one all-reduce over the pipeline's ranks, so every
        stage is scaled by the same factor, as torch's function would on the unsplit model.
        Every rank of the pipeline must call it. With DDP replicas of each stage the gradients
        are already averaged over the replicas; the norm is taken over the pipeline's stages.

        Args:
            max_norm: the largest norm the gradients may have.
            norm_type: ``p`` of the norm (a positive number, or ``inf``).
            error_if_nonfinite: raise if the total norm is ``nan`` or ``inf``.

        Returns:
            The total norm of the whole model's gradients (before clipping), on every rank.
        """
        params = [p for p in self.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        if not self.is_distributed:
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"Pipeline.clip_grad_norm_ needs a positive norm_type or inf, got "
                             f"{norm_type}")
        device = self.devices[0]
        inf = norm_type == float("inf")
        local = torch.zeros((), dtype=torch.float64, device=device)
        for grad in grads:
            norm = torch.linalg.vector_norm(grad.detach(), norm_type).to(device, torch.float64)
            local = torch.maximum(local, norm) if inf else local + norm ** norm_type
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        hang.run(group_progress(self.process_group), "Pipeline.clip_grad_norm_ all-reduce",
                 lambda: dist.all_reduce(local, op=op, group=self.process_group))
        total = local if inf else local ** (1.0 / norm_type)
        dtype = grads[0].dtype if grads else torch.float32
        total = total.to(dtype)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the pipeline's gradients is "
                f"{total.item()}, so they cannot be clipped; pass error_if_nonfinite=False to "
                "clip anyway")
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run ``inputs`` through every stage without gradients; :meth:`step` trains.

        Returns:
            The output on the last stage (``None`` on other ranks).
        """
        with torch.no_grad():
            return self._run(inputs, None, None, training=False)

    def step(
        self, *inputs: torch.Tensor, target: Any = None, losses: list | None = None
    ) -> Any:
        """Forward and backward of one batch, cut into ``chunks`` micro-batches.

        Gradients accumulate into ``.grad`` as one backward of ``loss_fn`` over the whole batch
        would (each micro-batch's mean loss is weighted by its share of the batch). With stages
        on ranks, the first stage passes ``inputs``, the last ``target``, the others nothing.

        Args:
            inputs: the batch (first stage).
            target: the batch's target (last stage); omitted, ``loss_fn(output)`` is called.
            losses: a list to which each micro-batch's loss is appended (last stage).

        Returns:
            The batch's output, the micro-batches' outputs joined (last stage; ``None`` elsewhere).

        Raises:
            ValueError: more micro-batches than samples, or inputs missing on the first stage.
            RuntimeError: no ``loss_fn``, called under ``torch.no_grad()``, or a stage failed
                (naming the stage and the input shapes it got).
        """
        if self.loss_fn is None:
            raise RuntimeError("Pipeline.step trains and needs loss_fn=...; use pipe(x) to infer")
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipeline.step runs backward: call it outside torch.no_grad()")
        return self._run(inputs, target, losses, training=True)

    def _run(self, inputs: tuple, target: Any, losses: list | None, training: bool) -> Any:
        first, last = 0 in self.stage_indices, self.num_stages - 1 in self.stage_indices
        microbatches = self._split_inputs(inputs) if first else None
        targets = _split(target, self.chunks, "target") if last and target is not None else None
        if targets is not None:
            targets = [_to(t, self.devices[-1]) for t in targets]
        sizes = ([int(mb[0].shape[0]) for mb in microbatches] if microbatches is not None
                 else None)
        if targets is not None and sizes is not None and sum(sizes) != target.shape[0]:
            raise ValueError(
                f"the target has {target.shape[0]} samples and the input {sum(sizes)}: give "
                "Pipeline.step one target per sample of the batch")
        scales = _loss_scales(targets, self.chunks, sizes)
        self._runners = self._make_runners()
        schedule = self.schedule(training)
        if self.is_distributed:
            # Hang reports name the step a stuck neighbour is at: one per pipeline step (a
            # stage wrapped in DDP counts its forwards too).
            group_progress(self.process_group).begin_step(
                f"pipeline {'step' if training else 'forward'}")
            peers = StagePeers(self.process_group, self.stage_indices[0], self.num_stages,
                               schedule)
            runner, actions = self._runners[0], schedule[self.stage_indices[0]]
            outs, loss_map = run_rank(runner, actions, peers, microbatches, targets, scales)
            outputs = [outs[i] for i in sorted(outs)]
            mb_losses = [loss_map[i] for i in sorted(loss_map)]
        else:
            assert microbatches is not None, "one process holds every stage, the first included"
            outputs, mb_losses = run_local(self._runners, schedule, microbatches, targets, scales)
        if losses is not None:
            losses.extend(mb_losses)
        if not last:
            return None
        joined = tuple(torch.cat(parts) for parts in zip(*outputs))
        return joined[0] if len(joined) == 1 else joined

    def _make_runners(self) -> list[StageRunner]:
        return [
            StageRunner(module, index, self.num_stages, device, self.loss_fn)
            for module, index, device in zip(self.stages, self.stage_indices, self.devices)
        ]

    def _split_inputs(self, inputs: tuple) -> list[tuple[torch.Tensor, ...]]:
        if not inputs:
            raise ValueError(
                "the first pipeline stage needs the batch: call pipe.step(x, ...) on its rank"
            )
        batch = as_tensor_tuple(inputs, "a pipeline input")
        parts = [_split(_to(t, self.devices[0]), self.chunks, f"input {i}")
                 for i, t in enumerate(batch)]
        return [tuple(p[k] for p in parts) for k in range(self.chunks)]


def _shared_message(shared: tuple[str, int, str, int], where: str) -> str:
    name, stage, other, other_stage = shared
    also = "" if other == name else f" (as {other!r} there)"
    return (
        f"parameter {name!r} is used by stage {stage} and by stage {other_stage}{also}: the "
        f"stages would run {where}. Put both uses on one stage (choose the cut with balance=[...]) "
        "or untie the parameter (give each use its own copy)"
    )


def _split(value: Any, chunks: int, what: str) -> list[torch.Tensor]:
    if not torch.is_tensor(value) or value.dim() == 0:
        raise ValueError(
            f"{what} must be a tensor with a batch dimension to cut into micro-batches"
        )
    size = value.shape[0]
    if chunks > size:
        raise ValueError(
            f"cannot cut a batch of {size} samples ({what}) into {chunks} micro-batches: use "
            f"chunks <= {size}, or a larger batch"
        )
    return list(torch.tensor_split(value, chunks))


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if torch.is_tensor(value) else value


def _loss_scales(targets: list | None, chunks: int, sizes: list[int] | None = None) -> list[float]:
    """Each micro-batch's share of the batch: counted on the targets, else on the inputs (this
    process holds the first stage too), else equal shares (the last stage of a pipeline over
    ranks without a target: exact when the batch divides into ``chunks`` equal parts)."""
    counts = [t.shape[0] for t in targets] if targets else sizes
    if not counts:
        return [1.0 / chunks] * chunks
    total = sum(counts)
    return [n / total for n in counts]
