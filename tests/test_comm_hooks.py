"""fp16/bf16/plain hooks: the reduction is the mean within the dtype's bound, bytes counted."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.comm import (
    ByteCounter,
    CommState,
    bf16_compress_hook,
    fp16_compress_hook,
    uncompressed_hook,
)
from lockstep.comm.state import resolve_state
from lockstep.ddp.comm_hooks import GradBucket

SHAPES = [(6, 5), (7,), (3, 4)]
# Relative precision of one rounding: 2^-11 for fp16 (11 significant bits), 2^-8 for bf16.
UNIT_ROUNDOFF = {
    fp16_compress_hook: 2.0**-11, bf16_compress_hook: 2.0**-8, uncompressed_hook: 2.0**-24
}


# ---- pure logic ---------------------------------------------------------------------------
def test_byte_counter_adds_sizes_and_steps():
    counter = ByteCounter()
    counter.record(torch.ones(4), torch.ones(3, dtype=torch.float16))
    assert counter.bytes_per_step() == 0.0
    counter.end_step()
    counter.record(torch.ones(2, dtype=torch.float64))
    counter.end_step()
    assert (counter.bytes_sent, counter.steps, counter.bytes_per_step()) == (38, 2, 19.0)
    counter.reset()
    assert (counter.bytes_sent, counter.steps) == (0, 0)


def test_resolve_state_rejects_unknown_state():
    with pytest.raises(TypeError, match="hook state must be None, a ProcessGroup or a CommState"):
        resolve_state(42)


# ---- multi-rank ---------------------------------------------------------------------------
def make_bucket(rank: int, scale: float = 1.0) -> tuple[GradBucket, torch.Tensor]:
    """A bucket over parameters of SHAPES whose gradients are rank-dependent random numbers."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    buffer = torch.randn(total, generator=torch.Generator().manual_seed(rank)) * scale
    return GradBucket(0, buffer, params, offsets, is_last=True), buffer.clone()


def _hook_reductions(rank: int) -> dict:
    lockstep.init_distributed()
    world = dist.get_world_size()
    locals_ = [make_bucket(r)[1] for r in range(world)]
    exact = torch.stack(locals_).mean(0)
    bound = torch.stack(locals_).abs().mean(0)
    out: dict = {}
    for hook in (uncompressed_hook, fp16_compress_hook, bf16_compress_hook):
        state = CommState()
        bucket, _ = make_bucket(rank)
        result = hook(state, bucket).wait()
        # Two roundings: each rank's g/N, then the sum; both are relative to at most mean |g|.
        limit = 2 * UNIT_ROUNDOFF[hook] * bound + 1e-7
        out[hook.__name__] = {
            "within_bound": bool(((result - exact).abs() <= limit).all()),
            "in_place": result.data_ptr() == bucket.buffer().data_ptr(),
            "dtype": result.dtype,
            "bytes": state.counter.bytes_per_step(),
        }
    bucket, _ = make_bucket(rank)
    bare = fp16_compress_hook(None, bucket).wait()  # torch's calling style: state is the group
    out["bare_group_state"] = torch.allclose(bare, exact, atol=1e-2)
    # 60000 on each rank: the fp16 sum (120000) would overflow; the mean (60000) does not.
    big = GradBucket(0, torch.full((4,), 60000.0), [torch.nn.Parameter(torch.zeros(4))], [0], True)
    out["fp16_no_overflow"] = fp16_compress_hook(None, big).wait().tolist()
    out["ddp"] = _hooks_under_ddp(rank, world)
    return out


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _hooks_under_ddp(rank: int, world: int) -> dict:
    """Each hook registered on a DDP model: its gradients against the full-batch reference."""
    data = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(7))
    reference = _net()
    reference(data).square().mean().backward()
    mine = data[4 * rank : 4 * (rank + 1)]
    errors = {}
    for hook in (uncompressed_hook, fp16_compress_hook, bf16_compress_hook):
        state = CommState()
        ddp = lockstep.DistributedDataParallel(_net())
        ddp.register_comm_hook(state, hook)
        ddp(mine).square().mean().backward()
        worst = max(
            ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
            for p, q in zip(ddp.parameters(), reference.parameters())
        )
        errors[hook.__name__] = (worst, state.counter.steps, state.counter.bytes_sent)
    errors["torch_wrappers_equal"] = _torch_wrappers_equal(mine)
    return errors


def _torch_wrappers_equal(mine: torch.Tensor) -> bool:
    """torch's fp16 compress wrapper: the same gradients under lockstep's DDP as under torch's
    (before 2026-11-28 set_buffer copied into the fp32 buffer: nothing was compressed). torch's
    bf16 wrapper refuses the CPU; it takes the same path."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    same = True
    for wrapper in (default_hooks.fp16_compress_wrapper,):
        grads = []
        for ddp_class in (torch.nn.parallel.DistributedDataParallel, lockstep.DistributedDataParallel):
            ddp = ddp_class(_net())
            ddp.register_comm_hook(None, wrapper(default_hooks.allreduce_hook))
            ddp(mine).square().mean().backward()
            grads.append([p.grad for p in ddp.parameters()])
        same = same and all(torch.equal(a, b) for a, b in zip(*grads))
    return same


@pytest.mark.multirank
def test_hooks_reduce_to_the_mean_within_dtype_bound_at_world_2():
    results = lockstep.spawn(_hook_reductions, 2, timeout=120)
    for out in results:
        for name in ("uncompressed_hook", "fp16_compress_hook", "bf16_compress_hook"):
            assert out[name]["within_bound"], name
            assert out[name]["in_place"] and out[name]["dtype"] == torch.float32, name
        numel = sum(torch.Size(s).numel() for s in SHAPES)
        assert out["uncompressed_hook"]["bytes"] == 4 * numel
        assert out["fp16_compress_hook"]["bytes"] == 2 * numel
        assert out["bf16_compress_hook"]["bytes"] == 2 * numel
        assert out["bare_group_state"]
        assert out["fp16_no_overflow"] == [60000.0] * 4
        ddp = out["ddp"]
        assert ddp["uncompressed_hook"][0] < 1e-5
        assert ddp["fp16_compress_hook"][0] < 2e-3
        assert ddp["bf16_compress_hook"][0] < 2e-2
        full_bytes = ddp["uncompressed_hook"][2]
        assert ddp["fp16_compress_hook"][2] * 2 == full_bytes == ddp["bf16_compress_hook"][2] * 2
        assert ddp.pop("torch_wrappers_equal")
        assert all(steps == 1 for _, steps, _ in ddp.values())


# ---- a hook that returns something else than a Future (issue 25, item 2) ------------------
def _returns_tensor_hook(state, bucket):
    return bucket.buffer()


def _bad_hook_error(rank: int) -> tuple[str, bool, str]:
    lockstep.init_distributed()
    ddp = lockstep.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(None, _returns_tensor_hook)
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test reports what was raised
        return type(exc).__name__, isinstance(exc, RuntimeError), str(exc)
    return "nothing", False, ""


@pytest.mark.multirank
def test_hook_returning_a_tensor_names_the_hook_not_a_peer():
    for rank, (kind, is_runtime, message) in enumerate(lockstep.spawn(_bad_hook_error, 2, timeout=120)):
        assert kind != "CollectiveTimeoutError" and is_runtime, (kind, message)
        assert message.startswith(f"rank {rank}: "), message
        assert "_returns_tensor_hook returned Tensor" in message and "Future" in message


def _raising_callback_hook(state, bucket):
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def callback(fut: torch.futures.Future) -> torch.Tensor:
        raise ValueError("bug in my hook's callback")

    return future.then(callback)


def _callback_error(rank: int) -> tuple[str, str]:
    lockstep.init_distributed()
    results = []
    for cls in (torch.nn.parallel.DistributedDataParallel, lockstep.DistributedDataParallel):
        ddp = cls(torch.nn.Linear(4, 2))
        ddp.register_comm_hook(None, _raising_callback_hook)
        try:
            ddp(torch.randn(3, 4)).sum().backward()
        except Exception as exc:  # noqa: BLE001 - the test reports what was raised
            results.append(f"{type(exc).__name__}: {exc}")
    return results[0], results[1]


@pytest.mark.multirank
def test_an_error_in_a_hooks_callback_is_raised_as_torch_raises_it_not_blamed_on_a_peer():
    for theirs, ours in lockstep.spawn(_callback_error, 2, timeout=120):
        # (the first line: torch appends the Python stack of whichever thread ran the callback)
        first = ours.splitlines()[0]
        assert first == theirs.splitlines()[0], (ours, theirs)  # was "did not arrive ... timeout"
        assert "ValueError: bug in my hook's callback" in ours


# ---- annotations are checked as torch checks them (issue 25, item 3) -----------------------
def _hook_bad_bucket(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def _hook_bad_return(state, bucket: GradBucket) -> torch.Tensor:
    raise AssertionError("never called")


def _hook_torch_bucket(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def _annotation_errors(rank: int) -> dict:
    lockstep.init_distributed()
    out: dict = {}
    for hook in (_hook_bad_bucket, _hook_bad_return, _hook_torch_bucket):
        for name, cls in (("lockstep", lockstep.DistributedDataParallel),
                          ("torch", torch.nn.parallel.DistributedDataParallel)):
            try:
                cls(torch.nn.Linear(2, 2)).register_comm_hook(None, hook)
                out[name, hook.__name__] = ("ok", "")
            except Exception as exc:  # noqa: BLE001 - the test compares the error types
                out[name, hook.__name__] = (type(exc).__name__, str(exc))
    return out


@pytest.mark.multirank
def test_register_comm_hook_checks_annotations_as_torch():
    out = lockstep.spawn(_annotation_errors, 1, timeout=120)[0]
    # This file's annotations are strings (from __future__ import annotations): torch rejects even
    # the right one then; lockstep compares names and accepts it. The wrong ones fail alike.
    for hook in ("_hook_bad_bucket", "_hook_bad_return"):
        assert out["lockstep", hook][0] == out["torch", hook][0], (hook, out)
    assert out["lockstep", "_hook_bad_bucket"][0] == "ValueError"
    assert "bucket annotation should be dist.GradBucket" in out["lockstep", "_hook_bad_bucket"][1]
    assert "return annotation should be" in out["lockstep", "_hook_bad_return"][1]
    assert out["lockstep", "_hook_torch_bucket"] == ("ok", "")


class _Complex(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat))
        self.out = torch.nn.Linear(3, 2)

    def forward(self, x):
        return (x @ self.w).abs().sum() + self.out((x @ self.w).real).sum()


def _clamping_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.append((bucket.buffer().dtype, [g.dtype for g in bucket.gradients()]))
    for grad in bucket.gradients():
        grad.clamp_(-0.05, 0.05)
    return default_hooks.allreduce_hook(None, bucket)


def _against_torch(rank: int, world: int) -> dict:
    """The same training under torch's DDP and lockstep's: complex parameters with and without
    torch's fp16 compression (the bucket is its real view), torch's fp16_compress_wrapper round
    a hook reading gradients() (the views of the fp16 buffer set_buffer gave), and a
    gradient-changing hook in a world of one (torch calls it there too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    lockstep.init_distributed()
    cases = {"complex": None, "complex_fp16": default_hooks.fp16_compress_hook,
             "fp16_wrapper_gradients": default_hooks.fp16_compress_wrapper(_clamping_hook),
             "clamp": _clamping_hook}
    out = {}
    for name, hook in cases.items():
        runs = []
        for cls in (torch.nn.parallel.DistributedDataParallel, lockstep.DistributedDataParallel):
            torch.manual_seed(0)
            model = cls(_Complex() if name.startswith("complex") else _net())
            seen: list = []
            if hook is not None:
                model.register_comm_hook(seen if "clamp" in name or "gradients" in name else None,
                                         hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                x = (torch.randn(5, 4, dtype=torch.cfloat, generator=g) if name.startswith("complex")
                     else torch.randn(8, 8, generator=g))
                opt.zero_grad()
                model(x).sum().backward() if not name.startswith("complex") else model(x).backward()
                opt.step()
            runs.append(([p.detach().clone() for p in model.parameters()], [str(s) for s in seen]))
        (theirs, seen_t), (ours, seen_o) = runs
        out[name] = (all(torch.equal(a, b) for a, b in zip(theirs, ours)), seen_t == seen_o, len(seen_o))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_complex_parameters_and_hooks_train_as_under_torchs_ddp(world):
    for rank_result in lockstep.spawn(_against_torch, world, args=(world,), timeout=120):
        for name, (equal, same_view, calls) in rank_result.items():
            assert equal, (world, name)
            assert same_view, (world, name)  # the hook saw the same dtypes as under torch
        assert rank_result["clamp"][2] == 3  # called every step, at world 1 too
