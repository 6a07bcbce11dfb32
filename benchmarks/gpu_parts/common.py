"""What every part shares: the run's sizes, the section a part returns, the model, timing.

A part is ``run(cfg) -> Section``. On a GPU it measures; with ``cfg.dry_run`` it runs the same
code on CPU with tiny sizes (gloo instead of NCCL) so the plumbing is tested without a GPU, and
every figure it writes is labelled as a dry-run figure, never as a GPU one.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Config", "Section", "Transformer", "batch_of", "deterministic", "device_sync", "md_table",
           "median_time", "shared_backend", "side_stream", "spawn_shared", "transformer"]


@dataclass(frozen=True)
class Config:
    """Sizes and switches of one acceptance run (pickled to spawned workers)."""

    dry_run: bool
    device: str  # "cuda:0" on a GPU, "cpu" in a dry run
    dtype_name: str  # "bfloat16" on a GPU, "float32" in a dry run
    vocab: int
    dim: int
    layers: int
    heads: int
    context: int
    batch: int
    steps: int  # timed steps per round
    rounds: int  # alternating rounds (ratios are medians over rounds)
    check_steps: int  # steps of a bitwise check
    repo: str  # the repository root (for pytest and the doctor)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def make(cls, dry_run: bool, repo: str) -> Config:
        if dry_run:
            return cls(True, "cpu", "float32", vocab=64, dim=32, layers=2, heads=2, context=16,
                       batch=2, steps=2, rounds=2, check_steps=3, repo=repo)
        # ~110M parameters: GPT-2 small's shape with a 32k vocabulary.
        return cls(False, "cuda:0", "bfloat16", vocab=32000, dim=768, layers=12, heads=12,
                   context=512, batch=8, steps=20, rounds=5, check_steps=8, repo=repo)


@dataclass
class Section:
    """One part's result: markdown for the report, data for the JSON, failures for the summary."""

    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.lines.extend(md_table(header, rows))
        self.lines.append("")

    def check(self, ok: bool, what: str) -> str:
        """Record a pass/fail claim; returns the cell text."""
        if not ok:
            self.failures.append(what)
        return "yes" if ok else "**NO**"


def md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Transformer(nn.Module):
    """A decoder-only language model (pre-norm encoder layers with a causal mask)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.dim))
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.heads, 4 * cfg.dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=self.pos.dtype)
        x = self.embed(idx) + self.pos[:t]
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def transformer(cfg: Config, seed: int = 0) -> nn.Module:
    """The benchmark model on ``cfg.device`` in ``cfg.dtype``, the same weights for one seed."""
    torch.manual_seed(seed)
    return Transformer(cfg).to(device=cfg.device, dtype=cfg.dtype)


def batch_of(cfg: Config, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of ``step`` for ``rank`` (deterministic)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.context + 1), generator=gen)
    idx = idx.to(cfg.device)
    return idx[:, :-1], idx[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def device_sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], steps: int, device: str) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls (device work included)."""
    device_sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    device_sync(device)
    return (time.perf_counter() - start) / steps


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextmanager
def side_stream(device: str) -> Iterator[Any]:
    """A new CUDA stream made current; it waits on the caller's stream first, and the caller's
    stream waits on it after, as a user's code must (torch orders nothing across streams that
    autograd does not see, e.g. the next backward accumulating into ``.grad``). CPU: nothing."""
    if not device.startswith("cuda"):
        with nullcontext():
            yield None
        return
    caller = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield stream
    caller.wait_stream(stream)


def deterministic(cfg: Config) -> None:
    """Make a worker's CUDA kernels deterministic, so bitwise claims test lockstep, not kernels.

    Call first in the worker, before any CUDA work: cuBLAS reads its workspace setting when its
    handle is made (and is not reproducible across streams without it); flash and
    memory-efficient attention accumulate with atomics in backward, so attention uses the math
    kernels here (timed parts keep the fast ones).
    """
    if not cfg.cuda:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def params_equal(a: nn.Module, b: nn.Module) -> tuple[bool, str]:
    """Whether every parameter is bitwise equal; else the first that differs and by how much."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if not torch.equal(p.detach(), q.detach()):
            diff = (p.detach().float() - q.detach().float()).abs().max().item()
            return False, f"{name} (max diff {diff:.3g})"
    return True, ""


def _probe(rank: int, device: str) -> bool:
    import torch.distributed as dist

    import lockstep

    lockstep.init_distributed(backend="nccl", device=device)
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return bool(t.item() == 2)


@functools.cache
def shared_backend(device: str) -> tuple[str, str]:
    """The backend two ranks on ``device`` can use, and why (probed once per run).

    NCCL usually rejects two ranks of one communicator on the same GPU ("Duplicate GPU
    detected"); gloo then carries the same CUDA tensors through host memory. The probe has a
    short timeout so that an NCCL that hangs instead of failing costs a minute, not a part.
    """
    import lockstep

    if not device.startswith("cuda"):
        return "gloo", "CPU"
    try:
        if all(lockstep.spawn(_probe, 2, args=(device,), timeout=90)):
            return "nccl", "NCCL accepted two ranks on one GPU"
        why = "NCCL's all-reduce gave a wrong sum"
    except lockstep.WorkerError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        why = "NCCL refused: " + (lines[-1][:200] if lines else repr(exc))
    return "gloo", why


def spawn_shared(worker: Callable[..., Any], cfg: Config, section: Section, timeout: float = 540,
                 args: tuple = ()) -> list[Any]:
    """Run ``worker(rank, cfg, backend, *args)`` on two ranks sharing ``cfg.device``.

    The report says which backend ran: only the functional claims (bitwise equality, memory per
    rank) are made at world 2, and they hold with either backend.
    """
    import lockstep

    backend, why = shared_backend(cfg.device)
    section.notes.append(f"world 2: two processes on {cfg.device}, backend {backend} ({why})")
    section.data["world2_backend"] = backend
    return lockstep.spawn(worker, 2, args=(cfg, backend, *args), timeout=timeout)
