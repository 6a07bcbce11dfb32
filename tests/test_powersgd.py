"""PowerSGD: exact on low-rank means, counts r(n+m) numbers, converges with error feedback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.comm import PowerSGDState, powersgd_hook
from lockstep.ddp.comm_hooks import GradBucket

N, M, R = 24, 20, 2
LR = 0.5
STEPS = 60


# ---- pure logic ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank must be at least 1"),
        ({"start_powersgd_iter": 1}, "start_powersgd_iter must be >= 2 with error feedback"),
        (
            {"start_powersgd_iter": -1, "use_error_feedback": False, "warm_start": False},
            "start_powersgd_iter must be >= 0",
        ),
        ({"min_compression_rate": 0.5}, "min_compression_rate must be a number >= 1"),
    ],
)
def test_state_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PowerSGDState(**kwargs)


def test_state_takes_torchs_keywords():
    """A script written for torch's PowerSGDState runs unchanged (its keyword spellings)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    kwargs = {"process_group": None, "matrix_approximation_rank": 2, "start_powerSGD_iter": 10,
              "min_compression_rate": 2, "use_error_feedback": True, "warm_start": True,
              "orthogonalization_epsilon": 1e-8, "random_seed": 0,
              "compression_stats_logging_frequency": 100, "batch_tensors_with_same_shape": True}
    torch_powersgd.PowerSGDState(**kwargs)  # the same keywords are torch's
    state = PowerSGDState(**kwargs)
    assert state.start_powersgd_iter == 10
    assert PowerSGDState(start_powerSGD_iter=10, start_powersgd_iter=10).start_powersgd_iter == 10
    with pytest.raises(TypeError, match="pass one of them"):
        PowerSGDState(start_powerSGD_iter=10, start_powersgd_iter=20)
    with pytest.raises(ValueError, match="orthogonalization_epsilon must be a number >= 0"):
        PowerSGDState(orthogonalization_epsilon=-1.0)


@pytest.mark.parametrize("kwargs", [{"matrix_approximation_rank": 2.0},
                                    {"matrix_approximation_rank": float("nan")},
                                    {"start_powersgd_iter": 10.5}])
def test_state_rejects_numbers_that_are_not_ints(kwargs):
    with pytest.raises(TypeError, match="must be an int"):  # 2.0 crashed at the first compression
        PowerSGDState(**kwargs)
    with pytest.raises(ValueError, match="min_compression_rate must be a number >= 1"):
        PowerSGDState(min_compression_rate=float("nan"))  # nan turned compression off


# ---- multi-rank ---------------------------------------------------------------------------
def _low_rank_bucket(rank: int) -> tuple[GradBucket, torch.Tensor]:
    """A matrix whose column space is shared by all ranks (so the mean has rank R), a vector
    (sent uncompressed) and a matrix too small to compress."""
    shared = torch.randn(N, R, generator=torch.Generator().manual_seed(100))
    own = torch.Generator().manual_seed(rank)
    matrix = shared @ torch.randn(R, M, generator=own)
    vector, small = torch.randn(5, generator=own), torch.randn(3, 2, generator=own)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((N, M), (5,), (3, 2))]
    flat = torch.cat([matrix.reshape(-1), vector, small.reshape(-1)])
    offsets = [0, N * M, N * M + 5]
    return GradBucket(0, flat.clone(), params, offsets, is_last=True), flat


def _exact_on_low_rank(rank: int, world: int) -> dict:
    state = PowerSGDState(
        matrix_approximation_rank=R, start_powersgd_iter=0, use_error_feedback=False,
        warm_start=False,
    )
    bucket, _ = _low_rank_bucket(rank)
    result = powersgd_hook(state, bucket).wait()
    exact = torch.stack([_low_rank_bucket(r)[1] for r in range(world)]).mean(0)
    expected_bytes = 4 * (R * (N + M) + 5 + 6)
    return {
        "max_error": (result - exact).abs().max().item(),
        "bytes": state.counter.bytes_per_step(),
        "expected_bytes": expected_bytes,
        "iter": state.iter,
    }


def _plain_steps_first(rank: int) -> bool:
    """Before start_powersgd_iter the hook is the exact mean, and the step count advances."""
    state = PowerSGDState(matrix_approximation_rank=1, start_powersgd_iter=2)
    full_rank = GradBucket(
        0, torch.randn(N * M, generator=torch.Generator().manual_seed(rank)),
        [torch.nn.Parameter(torch.zeros(N, M))], [0], True,
    )
    expected = full_rank.buffer().clone()
    dist.all_reduce(expected)
    return torch.allclose(powersgd_hook(state, full_rank).wait(), expected / 2) and state.iter == 1


def _exact_under_ddp(rank: int, world: int) -> float:
    """One sample per rank makes every weight gradient rank 1, so their mean over 2 ranks has
    rank 2: PowerSGD of rank 2 registered on DDP must then return the exact mean."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(N, M), torch.nn.Tanh(), torch.nn.Linear(M, 9))
    replica = torch.nn.Sequential(torch.nn.Linear(N, M), torch.nn.Tanh(), torch.nn.Linear(M, 9))
    replica.load_state_dict(net.state_dict())
    ddp = lockstep.DistributedDataParallel(net)
    ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=world, start_powersgd_iter=2),
                           powersgd_hook)
    for step in range(3):  # two plain steps, then the first compressed one
        x = torch.randn(1, N, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp.zero_grad()
        replica.zero_grad()
        ddp(x).square().sum().backward()
        replica(x).square().sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in replica.parameters()])
    dist.all_reduce(expected)
    got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    return ((got - expected / world).abs().max() / expected.abs().max()).item()


def _train(rank: int, world: int, hook_state: PowerSGDState | None, steps: int) -> tuple:
    """Linear regression towards a full-rank target; each rank sees its own samples."""
    torch.manual_seed(0)
    model = torch.nn.Linear(N, M)
    target = torch.nn.Linear(N, M)
    ddp = lockstep.DistributedDataParallel(model)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, powersgd_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = torch.Generator().manual_seed(1000 + rank)
    first = last = 0.0
    for step in range(steps):
        x = torch.randn(32, N, generator=data)
        with torch.no_grad():
            y = target(x)
        loss = (ddp(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    return first, last, all(torch.equal(c, flat) for c in copies)


def _sparse_embedding(rank: int, hook: bool) -> torch.Tensor:
    """A sparse embedding next to a compressible matrix: PowerSGD compresses the matrix and
    averages the embedding's sparse rows uncompressed (its bucket crashed once compressing
    began: a sparse tensor has no view)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, sparse=True)
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, ids: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).square().sum() + self.lin(z).sum()

    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(Net())
    if hook:
        model.register_comm_hook(PowerSGDState(start_powersgd_iter=2), powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(torch.tensor([rank, 3, 5 + step]), torch.randn(2, 32)).backward()
        opt.step()
    return model.module.emb.weight.detach().clone()


def _worker(rank: int) -> dict:
    lockstep.init_distributed()
    sparse = [_sparse_embedding(rank, hook) for hook in (True, False)]
    sparse_same = torch.allclose(*sparse, rtol=0, atol=1e-7)
    world = dist.get_world_size()
    out = {"exact": _exact_on_low_rank(rank, world), "plain_first": _plain_steps_first(rank)}
    out["exact_ddp"] = _exact_under_ddp(rank, world)
    ef = PowerSGDState(matrix_approximation_rank=1, start_powersgd_iter=2)
    out["ef"] = _train(rank, world, ef, STEPS) + (ef.counter.bytes_sent,)
    no_ef = PowerSGDState(matrix_approximation_rank=1, start_powersgd_iter=2,
                          use_error_feedback=False)
    out["no_ef"] = _train(rank, world, no_ef, STEPS)
    out["plain"] = _train(rank, world, None, STEPS)
    out["sparse_same"] = sparse_same
    return out


@pytest.mark.multirank
def test_powersgd_at_world_2():
    for out in lockstep.spawn(_worker, 2, timeout=120):
        exact = out["exact"]
        assert exact["max_error"] < 1e-4, exact
        assert exact["bytes"] == exact["expected_bytes"] and exact["iter"] == 1
        assert out["plain_first"]
        assert out["exact_ddp"] < 1e-4, out["exact_ddp"]
        first, last, same, sent = out["ef"]
        # Two plain steps of weight + bias, then rank-1 factors (M + N numbers) + the bias.
        assert sent == 2 * 4 * (N * M + M) + (STEPS - 2) * 4 * (N + M + M)
        plain_last = out["plain"][1]
        # Rank 1 of a full-rank 20 x 24 target: with error feedback it trains as fast as plain
        # averaging (about 1e-3 after 60 steps); without, it stalls near 0.3.
        assert same, "replicas diverged under PowerSGD"
        assert last < 5e-3 * first, out["ef"]
        assert last < 2 * plain_last, (last, plain_last)
        assert out["no_ef"][1] > 10 * last, "error feedback should matter on a full-rank target"
        assert out["sparse_same"], "the sparse embedding's rows are averaged as plain DDP does"


def test_state_with_a_group_pickles_without_it():
    # torch's PowerSGDState leaves its process group out of a pickle; so does this one
    # (it raised "cannot pickle 'ProcessGroup' object" before).
    import pickle

    lockstep.init_distributed()
    try:
        state = PowerSGDState(dist.new_group([0]), matrix_approximation_rank=2, start_powersgd_iter=5)
        state.iter = 3
        loaded = pickle.loads(pickle.dumps(state))
        assert loaded.process_group is None  # the default group, as torch's falls back to it
        assert (loaded.iter, loaded.matrix_approximation_rank) == (3, 2)
        assert torch.equal(loaded.generator.get_state(), state.generator.get_state())
    finally:
        lockstep.shutdown_distributed()
