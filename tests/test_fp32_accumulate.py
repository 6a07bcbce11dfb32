"""bf16 on the wire, the mean added up in fp32 (issue #16): no drift with ranks, bf16's bytes.

Tiers: the accumulation error of 64 simulated ranks (pure arithmetic, no process); argument
checks; the hook and DDP's ``reduce_dtype=`` at world 2 and 3 against a single-process
reference and torch's DDP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.comm import (
    CommState,
    FP32AccumulateState,
    bf16_compress_hook,
    bf16_fp32_accumulate_hook,
    fp32_accumulate_hook,
    fp32_accumulated_mean,
)
from lockstep.ddp.arguments import check_reduce_dtype
from lockstep.ddp.comm_hooks import GradBucket

RANKS = 64


# ---- 64 simulated ranks, one process --------------------------------------------------------
def _contributions(ranks: int, noise: float, n: int = 4096) -> torch.Tensor:
    """Each rank's gradient: a signal shared by all ranks plus rank-specific noise."""
    gen = torch.Generator().manual_seed(0)
    signal = torch.randn(n, generator=gen)
    return signal + noise * torch.randn(ranks, n, generator=gen)


def _ring_bf16_mean(rows: torch.Tensor) -> torch.Tensor:
    """What bf16_compress_hook's all-reduce computes: divide, cast, then add rank after rank with
    every partial sum rounded to bf16, as each hop of a ring does."""
    wire = (rows / rows.shape[0]).bfloat16()
    total = wire[0].clone()
    for row in wire[1:]:
        total = total + row  # bf16 + bf16: rounded to bf16 at every hop
    return total.float()


def _relative_error(estimate: torch.Tensor, exact: torch.Tensor) -> float:
    return ((estimate.double() - exact).norm() / exact.norm()).item()


def relative_errors(ranks: int, noise: float) -> dict[str, float]:
    rows = _contributions(ranks, noise)
    exact = rows.double().mean(0)
    fp32_accumulated = fp32_accumulated_mean(rows.bfloat16()).bfloat16()  # as the all-gather sends it
    return {
        "ring_bf16": _relative_error(_ring_bf16_mean(rows), exact),
        "fp32_accumulated": _relative_error(fp32_accumulated.float(), exact),
        "one_rounding": _relative_error(exact.float().bfloat16().float(), exact),
    }


@pytest.mark.parametrize("noise, ratio", [(0.1, 5.0), (1.0, 3.0)])
def test_fp32_accumulation_does_not_drift_with_64_ranks(noise: float, ratio: float):
    # Measured (relative error of the mean, 4096 numbers):
    #   ranks agree (noise 0.1): ring 1.3e-2, fp32-accumulated 1.7e-3, one rounding 1.7e-3;
    #   noise = signal (1.0):    ring 7.6e-3, fp32-accumulated 1.7e-3, one rounding 1.7e-3.
    two = relative_errors(2, noise)  # a bf16 sum of two bf16 numbers is one rounding anyway
    assert two["ring_bf16"] == two["fp32_accumulated"]
    errors = relative_errors(RANKS, noise)
    assert errors["fp32_accumulated"] < 1.1 * errors["one_rounding"]
    assert errors["ring_bf16"] > ratio * errors["fp32_accumulated"]
    # The ring's error grows with the number of ranks; the fp32-accumulated one does not.
    few = relative_errors(4, noise)
    assert errors["ring_bf16"] > 2 * few["ring_bf16"]
    assert errors["fp32_accumulated"] <= few["fp32_accumulated"]


def test_fp32_accumulated_mean_is_float32_and_exact_for_representable_inputs():
    rows = torch.tensor([[256.0, 1.0], [1.0, 1.0], [1.0, 1.0]]).bfloat16()
    mean = fp32_accumulated_mean(rows)
    assert mean.dtype == torch.float32
    assert mean.tolist() == [86.0, 1.0]  # 258/3: in bf16, 256 + 1 would round back to 256
    assert fp32_accumulated_mean(rows, torch.float64).dtype == torch.float64


# ---- argument checks --------------------------------------------------------------------------
def test_reduce_dtype_is_checked_where_it_is_given():
    assert check_reduce_dtype(None, None) is None
    assert check_reduce_dtype(torch.bfloat16, None) is torch.bfloat16
    with pytest.raises(TypeError, match="reduce_dtype must be a floating-point torch.dtype"):
        check_reduce_dtype("bf16", None)
    with pytest.raises(TypeError, match="got torch.int32"):
        check_reduce_dtype(torch.int32, None)
    with pytest.raises(ValueError, match="both given"):
        check_reduce_dtype(torch.bfloat16, torch.float16)
    with pytest.raises(TypeError, match="wire_dtype"):
        FP32AccumulateState(wire_dtype=torch.int8)
    # The constructor checks it before it looks for a process group.
    with pytest.raises(TypeError, match="reduce_dtype"):
        lockstep.DistributedDataParallel(torch.nn.Linear(2, 2), reduce_dtype=torch.int64)


# ---- world 2 and 3 ---------------------------------------------------------------------------
SIZES = [(6, 5), (7,), (3, 4)]  # 49 numbers: a padded last chunk at world 2 and 3


def _bucket(rank: int) -> GradBucket:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SIZES]
    offsets = [0, 30, 37]
    buffer = torch.randn(49, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    return GradBucket(0, buffer, params, offsets, is_last=True)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t)
    return copies


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _worst(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest error relative to each reference gradient's largest entry."""
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))


def _hook_and_ddp(rank: int) -> dict:
    lockstep.init_distributed()
    world = dist.get_world_size()
    out: dict = {}
    # The hook alone: bitwise the shared pure function over every rank's bf16 contribution.
    rows = torch.stack([_bucket(r).buffer() for r in range(world)])
    expected = fp32_accumulated_mean(rows.bfloat16()).bfloat16().float()
    for name, hook, state in (
        ("generic", fp32_accumulate_hook, FP32AccumulateState()),
        ("bf16", bf16_fp32_accumulate_hook, CommState()),
        ("bare_group", bf16_fp32_accumulate_hook, None),
    ):
        bucket = _bucket(rank)
        result = hook(state, bucket).wait()
        out[name] = {
            "equal": torch.equal(result, expected),
            "in_place": result.data_ptr() == bucket.buffer().data_ptr(),
            "dtype": result.dtype,
            "bytes": state.counter.bytes_sent if state is not None else None,
        }
    compressed = CommState()
    bf16_compress_hook(compressed, _bucket(rank)).wait()
    out["bf16_compress_bytes"] = compressed.counter.bytes_sent
    # DDP(reduce_dtype=bf16) against the full-batch gradients and torch's DDP.
    data = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(7))
    reference = _net()
    reference(data).square().mean().backward()
    mine = data[4 * rank : 4 * (rank + 1)]
    ddp = lockstep.DistributedDataParallel(_net(), reduce_dtype=torch.bfloat16)
    theirs = torch.nn.parallel.DistributedDataParallel(_net())
    for model in (ddp, theirs):
        model(mine).square().mean().backward()
    grads = _grads(ddp)
    out["ddp_vs_reference"] = _worst(grads, _grads(reference))
    out["ddp_vs_torch"] = _worst(grads, _grads(theirs))
    out["grad_dtypes"] = {g.dtype for g in grads}
    flat = torch.cat([g.reshape(-1) for g in grads])
    out["same_on_all_ranks"] = all(torch.equal(c, flat) for c in _gather(flat))
    out["sparse"] = _sparse_embedding(rank, world)
    out["join"] = _uneven_inputs(rank, world)
    try:
        ddp.register_comm_hook(None, bf16_compress_hook)
    except RuntimeError as exc:
        out["second_hook"] = str(exc)
    # fp16 on the wire: rank 0's 1e5 alone overflows fp16 (65504); the mean, 1e5 / world, fits
    big = GradBucket(0, torch.tensor([1e5 if rank == 0 else 0.0, 1.0]), [], [0], True)
    out["fp16_big"] = fp32_accumulate_hook(
        FP32AccumulateState(wire_dtype=torch.float16), big).wait().tolist()
    return out


class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def _sparse_embedding(rank: int, world: int) -> float:
    """A sparse embedding's bucket is averaged uncompressed; the dense one in bf16 (largest
    error relative to the full-batch gradients)."""
    ids = torch.randint(0, 10, (2 * world, 3), generator=torch.Generator().manual_seed(3))
    reference = _Bag()
    reference(ids).square().mean().backward()
    ddp = lockstep.DistributedDataParallel(_Bag(), reduce_dtype=torch.bfloat16)
    ddp(ids[2 * rank : 2 * (rank + 1)]).square().mean().backward()
    grads = [g.to_dense() for g in _grads(ddp)]
    return _worst(grads, [g.to_dense() for g in _grads(reference)])


def _uneven_inputs(rank: int, world: int) -> float:
    """join(): ranks with fewer batches shadow the hook's all-to-all and all-gather. Returns the
    largest parameter error against a one-process run averaging the active ranks' shards."""
    batches = [3, 1, 2][:world]  # rank 1 runs out first

    def data(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(10 * step + r)
        return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)

    ddp = lockstep.DistributedDataParallel(_net(), reduce_dtype=torch.bfloat16)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join(divide_by_initial_world_size=False):
        for step in range(batches[rank]):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(data(step, rank)[0]), data(step, rank)[1]).backward()
            opt.step()
    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(max(batches)):
        active = [r for r in range(world) if step < batches[r]]
        ref_opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(reference(data(step, r)[0]), data(step, r)[1])
                  for r in active]
        torch.stack(losses).mean().backward()
        ref_opt.step()
    return max((a - b).abs().max().item()
               for a, b in zip(ddp.module.parameters(), reference.parameters()))


def _check(results: list[dict]) -> None:
    for out in results:
        for name in ("generic", "bf16", "bare_group"):
            assert out[name]["equal"], name
            assert out[name]["in_place"] and out[name]["dtype"] == torch.float32, name
        assert out["generic"]["bytes"] == out["bf16"]["bytes"] == out["bf16_compress_bytes"] == 2 * 49
        assert out["ddp_vs_reference"] < 1e-2  # bf16: 8 significant bits
        assert out["ddp_vs_torch"] < 1e-2
        assert out["grad_dtypes"] == {torch.float32}
        assert out["sparse"] < 1e-2
        assert out["join"] < 1e-3
        assert out["same_on_all_ranks"]
        assert "reduce_dtype installed lockstep.comm.fp32_accumulate_hook" in out["second_hook"]
        world = len(results)
        assert out["fp16_big"] == pytest.approx([1e5 / world, 1.0], rel=1e-3), out["fp16_big"]


@pytest.mark.multirank
def test_fp32_accumulate_at_world_2():
    _check(lockstep.spawn(_hook_and_ddp, 2, timeout=120))


@pytest.mark.multirank
def test_fp32_accumulate_at_world_3():
    _check(lockstep.spawn(_hook_and_ddp, 3, timeout=120))
