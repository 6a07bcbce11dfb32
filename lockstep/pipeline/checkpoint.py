"""Checkpoints of a pipeline over ranks: each rank saves and restores its own stage.

With one stage per rank, a rank's stage (and the optimizer stepping it) is that rank's alone, so
neither can be saved the usual way (rank 0's copy, restored on every rank). Both follow the
Checkpointer's sharded protocol (:mod:`lockstep.checkpoint.sharded`) instead: every rank writes
its piece, tagged with its stage, and a restore takes the piece of the same stage of a pipeline
of as many stages, whichever rank wrote it (so a pipeline with another number of data-parallel
replicas restores too).

The stages' parameters carry the mark of :func:`lockstep.shards.mark_rank_local`, so that the
Checkpointer refuses them given plainly, naming what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.checkpoint.io import CheckpointError
from lockstep.checkpoint.state import load_model_state
from lockstep.wrappers import unwrap_model

__all__ = ["StageOptimizerState", "find_stage_piece", "stage_piece"]


def stage_piece(stage: int, num_stages: int, state: Any) -> dict[str, Any]:
    """This rank's piece: ``state`` tagged with the stage it belongs to."""
    return {"stage": stage, "num_stages": num_stages, "state": state}


def find_stage_piece(pieces: Sequence[Any], stage: int, num_stages: int, what: str) -> Any:
    """The saved state of stage ``stage`` of ``num_stages``, from the pieces of every rank.

    This rank's own piece is read first (the same world restoring); otherwise the others in
    rank order, so a restore reads one file when the layout is unchanged.

    Raises:
        CheckpointError: no rank saved that stage (another number of stages, or not a pipeline).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    order = ([rank] if rank < len(pieces) else []) + [r for r in range(len(pieces)) if r != rank]
    seen = set()
    for r in order:
        piece = pieces[r]
        if not isinstance(piece, dict) or "stage" not in piece:
            raise CheckpointError(
                f"{getattr(pieces, 'source', 'the checkpoint')}: {what} was not saved by a "
                "Pipeline's stages (its pieces carry no stage)")
        seen.add((piece["stage"], piece["num_stages"]))
        if piece["stage"] == stage and piece["num_stages"] == num_stages:
            return piece["state"]
    counts = sorted({n for _, n in seen})
    raise CheckpointError(
        f"{getattr(pieces, 'source', 'the checkpoint')} holds no stage {stage} of a {num_stages}-"
        f"stage pipeline for {what}: it was saved by a pipeline of {counts} stage(s). Restore "
        "with the number of stages that saved it."
    )


class StageOptimizerState:
    """What to give :class:`lockstep.Checkpointer` for the optimizer of a pipeline's stage.

    Made by :meth:`lockstep.Pipeline.optimizer_state`: ``ckpt.save(step, model=pipe,
    optimizer=pipe.optimizer_state(optimizer))`` and the same in ``restore``.
    """

    save_sharded = True

    def __init__(self, stage: int, num_stages: int, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Pipeline.optimizer_state takes the torch optimizer of this rank's stage, got "
                f"{type(optimizer).__name__}")
        self.stage, self.num_stages, self.optimizer = stage, num_stages, optimizer

    def sharded_state_dict(self) -> dict[str, Any]:
        return stage_piece(self.stage, self.num_stages, self.optimizer.state_dict())

    def load_sharded_state_dict(self, pieces: Sequence[Any]) -> None:
        state = find_stage_piece(pieces, self.stage, self.num_stages, "the optimizer")
        try:
            self.optimizer.load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(
                f"{getattr(pieces, 'source', 'the checkpoint')}: the optimizer of stage "
                f"{self.stage} does not fit this {type(self.optimizer).__name__} "
                f"({type(exc).__name__}: {exc})") from exc


def stage_state(stage: int, num_stages: int, module: nn.Module) -> dict[str, Any]:
    """The piece of a stage module: its weights without any wrapper's prefix."""
    return stage_piece(stage, num_stages, unwrap_model(module).state_dict())


def load_stage_state(pieces: Sequence[Any], stage: int, num_stages: int, module: nn.Module) -> None:
    """Load stage ``stage``'s saved weights into ``module`` (wrapped or not)."""
    state = find_stage_piece(pieces, stage, num_stages, "the pipeline's weights")
    load_model_state(module, state, f"{getattr(pieces, 'source', 'the checkpoint')} (stage {stage})")
