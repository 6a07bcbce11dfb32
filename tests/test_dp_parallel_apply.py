"""parallel_apply: replicas run at once, carry the caller's torch settings, and errors name them."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lockstep.dp.parallel_apply import parallel_apply


class _Meets(nn.Module):
    """Waits for every other replica: proves they run at the same time (or times out)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.barrier.wait()
        return self.lin(x) * scale


def test_replicas_run_concurrently_and_results_keep_order():
    barrier = threading.Barrier(3, timeout=20)
    mods = [_Meets(barrier) for _ in range(3)]
    xs = [(torch.full((1, 2), float(i)),) for i in range(3)]
    outs = parallel_apply(mods, xs, [{"scale": 2.0}] * 3, devices=["cpu"] * 3)
    for m, (x,), out in zip(mods, xs, outs):
        torch.testing.assert_close(out, m.lin(x) * 2.0)


def test_grad_inference_and_autocast_modes_follow_the_caller():
    lin = nn.Linear(4, 4)
    xs = [(torch.randn(2, 4),), (torch.randn(2, 4),)]
    assert all(out.requires_grad for out in parallel_apply([lin, lin], xs))
    with torch.no_grad():
        assert not any(out.requires_grad for out in parallel_apply([lin, lin], xs))
    with torch.inference_mode():
        assert all(out.is_inference() for out in parallel_apply([lin, lin], xs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(out.dtype == torch.bfloat16 for out in parallel_apply([lin, lin], xs))


def test_single_input_need_not_be_a_tuple():
    outs = parallel_apply([torch.neg, torch.neg], [torch.ones(1), torch.zeros(1)])
    assert [o.item() for o in outs] == [-1.0, 0.0]


def _fails_on_negative(x: torch.Tensor) -> torch.Tensor:
    if x.item() < 0:
        raise KeyError(f"bad value {x.item()}")
    return x


class _TwoArgError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def _two_arg_error(x: torch.Tensor) -> torch.Tensor:
    raise _TwoArgError(7, "custom")


def test_a_replica_error_is_reraised_naming_replica_and_device():
    with pytest.raises(KeyError, match=r"replica 1 on device cpu raised KeyError: 'bad value -1.0'") as info:
        parallel_apply([_fails_on_negative] * 2, [torch.ones(()), -torch.ones(())])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(KeyError, match=r"replica 0 .* \(1 other replica\(s\) failed too\)"):
        parallel_apply([_fails_on_negative] * 2, [-torch.ones(()), -torch.ones(())])
    with pytest.raises(RuntimeError, match=r"replica 0 on device cpu raised _TwoArgError: 7: custom") as info:
        parallel_apply([_two_arg_error], [torch.ones(())])
    assert isinstance(info.value.__cause__, _TwoArgError)


def test_length_mismatch_errors():
    with pytest.raises(ValueError, match="got 2 modules but 1 inputs"):
        parallel_apply([torch.neg, torch.neg], [torch.ones(1)])
    with pytest.raises(ValueError, match="got 1 modules but 2 kwargs"):
        parallel_apply([torch.neg], [torch.ones(1)], [{}, {}])


@pytest.mark.gpu
def test_parallel_apply_runs_each_replica_on_its_gpu():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    mods = [nn.Linear(3, 3).to(d) for d in devices]
    xs = [(torch.randn(2, 3, device=d),) for d in devices]
    outs = parallel_apply(mods, xs)
    for m, (x,), out, d in zip(mods, xs, outs, devices):
        assert out.device == d
        torch.testing.assert_close(out, m(x))


def test_cpu_in_order_runs_cpu_replicas_one_after_another_and_survives_an_error():
    order: list[int] = []

    def record(i: int, fail: bool = False) -> int:
        order.append(i)
        if fail:
            raise ValueError(f"replica {i} failed")
        return i

    calls = [lambda i=i: record(i) for i in range(4)]
    for _ in range(5):
        order.clear()
        assert parallel_apply(calls, [()] * 4, devices=["cpu"] * 4, cpu_in_order=True) == [0, 1, 2, 3]
        assert order == [0, 1, 2, 3]
    failing = [lambda: record(0, fail=True)] + calls[1:]
    with pytest.raises(ValueError, match="replica 0 on device cpu raised ValueError"):
        parallel_apply(failing, [()] * 4, devices=["cpu"] * 4, cpu_in_order=True)  # no deadlock
