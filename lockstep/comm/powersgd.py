"""PowerSGD: send a rank-r approximation of each gradient matrix instead of the matrix.

An n x m gradient M is approximated as P Q^T with P (n x r) and Q (m x r), found by one step
of subspace (power) iteration per training step (Vogels et al., "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", NeurIPS 2019):

1. ``P = M Q``; all-reduce P (sum); orthonormalise P's columns.
2. ``Q = M^T P``; all-reduce Q and divide by the world size, so ``P Q^T`` approximates the
   mean of the ranks' M (P is shared, and M -> M^T P is linear).

Only ``r (n + m)`` numbers travel instead of ``n m``. Three details make it train as well as
plain averaging: *error feedback* adds what the last approximation missed to the next gradient,
so nothing is lost, only delayed; *warm start* reuses last step's Q, so one power step per
training step converges over time; and the first ``start_powersgd_iter`` steps use a plain
all-reduce, while early gradients change too fast for a low rank to follow. Vectors (biases,
norms) and matrices too small to gain are sent uncompressed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm.compression import compress_hook
from lockstep.comm.hooks import GradBucket, completed_future
from lockstep.comm.state import ByteCounter
from lockstep.distributed import resolve_group

__all__ = ["PowerSGDState", "powersgd_hook"]

logger = logging.getLogger(__name__)


class PowerSGDState:
    """What PowerSGD remembers between steps: Q for warm start, the error, the step count.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
        matrix_approximation_rank: r, the rank of each approximation (1 to 4 are typical).
        start_powersgd_iter: steps of plain all-reduce before compressing.
        min_compression_rate: compress a matrix only if it shrinks at least this many times.
        use_error_feedback: carry each step's approximation error into the next gradient.
        warm_start: start each power step from last step's Q rather than a random one.
        random_seed: seed of the random Q; the same on every rank, so the Qs agree.
        counter: where the bytes sent are added up (a new one by default).
        start_powerSGD_iter: torch's spelling of ``start_powersgd_iter`` (either may be given).
        orthogonalization_epsilon: accepted for torch's signature (must be >= 0); P's columns
            are orthonormalised by a QR factorisation, which needs no epsilon for a zero column.
        compression_stats_logging_frequency: accepted for torch's signature; the bytes sent
            are counted in ``counter`` every step instead of logged.
        batch_tensors_with_same_shape: accepted for torch's signature; every matrix of a bucket
            already travels in the same two all-reduces.

    Raises:
        ValueError: a rank below 1, a start step below 2 with error feedback or warm start
            (below 0 without), or a compression rate below 1.

    Example::

        state = lockstep.PowerSGDState(matrix_approximation_rank=4, start_powersgd_iter=10)
        ddp.register_comm_hook(state, lockstep.powersgd_hook)
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powersgd_iter: int = 1000,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
        counter: ByteCounter | None = None,
        *,
        start_powerSGD_iter: int | None = None,  # torch spells it so
        orthogonalization_epsilon: float = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if start_powerSGD_iter is not None:  # torch's name for start_powersgd_iter
            if start_powersgd_iter not in (1000, start_powerSGD_iter):
                raise TypeError(
                    f"PowerSGDState got start_powerSGD_iter={start_powerSGD_iter} and "
                    f"start_powersgd_iter={start_powersgd_iter}: pass one of them (the same "
                    "setting, spelled as torch does and as lockstep does)"
                )
            start_powersgd_iter = start_powerSGD_iter
        if not orthogonalization_epsilon >= 0:  # NaN too
            raise ValueError(
                f"orthogonalization_epsilon must be a number >= 0, got {orthogonalization_epsilon}")
        if not isinstance(compression_stats_logging_frequency, int) or (
                compression_stats_logging_frequency < 1):
            raise ValueError("compression_stats_logging_frequency must be a positive int, got "
                             f"{compression_stats_logging_frequency!r}")
        for name, value in (("matrix_approximation_rank", matrix_approximation_rank),
                            ("start_powersgd_iter", start_powersgd_iter)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not min_compression_rate >= 1:  # NaN too
            raise ValueError(f"min_compression_rate must be a number >= 1, got {min_compression_rate}")
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"matrix_approximation_rank must be at least 1, got {matrix_approximation_rank}"
            )
        if start_powersgd_iter < 0:
            raise ValueError(f"start_powersgd_iter must be >= 0, got {start_powersgd_iter}")
        if start_powersgd_iter < 2 and (use_error_feedback or warm_start):
            # DDP rebuilds its buckets after the first iteration; error and Q memories kept
            # per bucket before that would be applied to the wrong gradients afterwards.
            raise ValueError(
                f"start_powersgd_iter must be >= 2 with error feedback or warm start, got "
                f"{start_powersgd_iter}: DDP regroups its buckets after the first step"
            )
        if min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powersgd_iter = start_powersgd_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.counter = counter if counter is not None else ByteCounter()
        self.iter = 0
        self.generator = torch.Generator().manual_seed(random_seed)
        # Per bucket index: the error not yet applied, and the flat Q memory for warm start.
        self.error_dict: dict[int, torch.Tensor] = {}
        self.q_dict: dict[int, torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled (as torch's state)."""
        state = dict(self.__dict__)
        if state.get("process_group") is not None:
            logger.warning("PowerSGDState: the process group is not saved with the state; a "
                           "loaded state reduces over the default group")
        state["process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def end_bucket(self, bucket: GradBucket) -> None:
        """Count one training step after the last bucket of an iteration."""
        if not bucket.is_last():
            return
        self.iter += 1
        if self.iter == self.start_powersgd_iter:
            logger.info("PowerSGD: compressing gradients from step %d on", self.iter)


@dataclass
class _Matrix:
    """One gradient viewed as an n x m matrix, with where its P and Q live in the flat buffers."""

    grad: torch.Tensor
    start: int
    rank: int
    p_offset: int
    q_offset: int

    @property
    def p_size(self) -> int:
        return self.grad.shape[0] * self.rank

    @property
    def q_size(self) -> int:
        return self.grad.shape[1] * self.rank


def _split(
    state: PowerSGDState, grad: torch.Tensor, bucket: GradBucket
) -> tuple[list[_Matrix], list[torch.Tensor]]:
    """Sort the bucket's gradients (views of ``grad``) into compressible matrices and the rest."""
    matrices: list[_Matrix] = []
    rest: list[torch.Tensor] = []
    p_total = q_total = 0
    for param, offset in zip(bucket.parameters(), bucket.offsets()):
        view = grad[offset : offset + param.numel()]
        if param.dim() > 1:
            n, m = param.shape[0], param.numel() // param.shape[0]
            rank = min(state.matrix_approximation_rank, n, m)
            if n * m >= state.min_compression_rate * rank * (n + m):
                matrices.append(_Matrix(view.view(n, m), offset, rank, p_total, q_total))
                p_total += n * rank
                q_total += m * rank
                continue
        rest.append(view)
    return matrices, rest


def _q_memory(state: PowerSGDState, index: int, size: int, like: torch.Tensor) -> torch.Tensor:
    """The bucket's flat Q: last step's (warm start) or fresh, identical on every rank."""
    q = state.q_dict.get(index)
    if q is None or q.numel() != size or not state.warm_start:
        if q is not None and q.numel() != size:
            logger.warning("PowerSGD: bucket %d changed size; restarting its Q", index)
        # Drawn on the CPU from the shared seed, so every rank and device draws the same Q.
        q = torch.randn(size, generator=state.generator).to(like)
        state.q_dict[index] = q
    return q


def _error(state: PowerSGDState, index: int, like: torch.Tensor) -> torch.Tensor:
    error = state.error_dict.get(index)
    if error is None or error.numel() != like.numel():
        error = torch.zeros_like(like)
        state.error_dict[index] = error
    return error


def _low_rank_mean(
    state: PowerSGDState, group: dist.ProcessGroup, matrices: list[_Matrix], q_flat: torch.Tensor
) -> list[torch.Tensor]:
    """One power step over all matrices at once: two all-reduces, whatever their number."""
    world = dist.get_world_size(group)
    p_flat = q_flat.new_empty(sum(mat.p_size for mat in matrices))
    ps, qs = [], []
    for mat in matrices:
        n, m = mat.grad.shape
        q = q_flat[mat.q_offset : mat.q_offset + mat.q_size].view(m, mat.rank)
        p = p_flat[mat.p_offset : mat.p_offset + mat.p_size].view(n, mat.rank)
        torch.matmul(mat.grad, q, out=p)
        ps.append(p)
        qs.append(q)
    state.counter.record(p_flat)
    dist.all_reduce(p_flat, group=group)
    for mat, p, q in zip(matrices, ps, qs):
        # Orthonormal columns make M^T P the projection of M onto span(P) in the next line.
        p.copy_(torch.linalg.qr(p).Q)
        torch.matmul(mat.grad.t(), p, out=q)
    state.counter.record(q_flat)
    dist.all_reduce(q_flat, group=group)
    q_flat.div_(world)
    return [p @ q.t() for p, q in zip(ps, qs)]


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with rank-r approximations of its matrices (see the module docstring).

    The power step's two all-reduces depend on each other, so this hook blocks until they are
    done (the uncompressed part is all-reduced meanwhile) and returns a completed future.

    Args:
        state: a :class:`PowerSGDState`, kept across steps.
        bucket: the gradients to reduce.

    Returns:
        A future holding the bucket buffer, now the approximate mean over ranks.
    """
    if state.iter < state.start_powersgd_iter or bucket.buffer().is_sparse:
        # (A sparse embedding's bucket holds the rows each rank looked up, not a matrix to
        # approximate: it is averaged uncompressed, as fp32_accumulate_hook does.)
        fut = compress_hook(state, bucket, None)
        state.end_bucket(bucket)
        return fut
    group = resolve_group(state.process_group)
    buffer = bucket.buffer()
    # Work in at least float32: QR and error feedback need the precision fp16/bf16 lack.
    grad = buffer if buffer.dtype in (torch.float32, torch.float64) else buffer.float()
    if state.use_error_feedback:
        grad.add_(_error(state, bucket.index(), grad))
    matrices, rest = _split(state, grad, bucket)
    pending = None
    if rest:
        flat_rest = torch.cat([t.reshape(-1) for t in rest]).div_(dist.get_world_size(group))
        state.counter.record(flat_rest)
        pending = dist.all_reduce(flat_rest, group=group, async_op=True)
    if matrices:
        _compress_matrices(state, group, bucket.index(), grad, matrices)
    if pending is not None:
        pending.wait()
        _scatter(flat_rest, rest)
    if grad is not buffer:
        buffer.copy_(grad)
    if bucket.is_last():
        state.counter.end_step()
    state.end_bucket(bucket)
    return completed_future(buffer)


def _compress_matrices(
    state: PowerSGDState,
    group: dist.ProcessGroup,
    index: int,
    grad: torch.Tensor,
    matrices: list[_Matrix],
) -> None:
    """Replace each matrix by the approximate mean; remember what was missed as the error."""
    q_flat = _q_memory(state, index, sum(mat.q_size for mat in matrices), grad)
    approximations = _low_rank_mean(state, group, matrices, q_flat)
    error = _error(state, index, grad) if state.use_error_feedback else None
    for mat, approx in zip(matrices, approximations):
        if error is not None:
            error_view = error[mat.start : mat.start + mat.grad.numel()].view_as(mat.grad)
            torch.sub(mat.grad, approx, out=error_view)
        mat.grad.copy_(approx)


def _scatter(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into the tensors it was concatenated from."""
    start = 0
    for view in views:
        view.copy_(flat[start : start + view.numel()].view_as(view))
        start += view.numel()
