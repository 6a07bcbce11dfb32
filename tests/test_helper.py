"""The training helper: Runtime, ShardedLoader, metric reduction and evaluation gathering."""

from __future__ import annotations

import contextlib
import io
import sys
from collections import namedtuple

import numpy as np
import pytest
import torch

# Building the first optimizer imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; import it
# before conftest's environment-leak check takes its snapshot.
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.helper import ShardedLoader, move_to_device


class _Noise(torch.utils.data.Dataset):
    """Each item is a NumPy random draw: shows whether workers are seeded apart."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> float:
        import numpy as np

        return float(np.random.rand())


# --- a world of one, in this process -----------------------------------------------------------


def test_world_of_one_runtime_covers_every_piece(capsys):
    with lockstep.Runtime() as rt:
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert (rt.rank, rt.world_size, rt.is_main, rt.device.type) == (0, 1, True, expected)
        model = nn.Linear(3, 2)
        assert rt.wrap(model) is model  # nothing to synchronise with one worker
        assert rt.unwrap(model) is model
        with rt.no_sync(model):
            pass
        assert rt.all_reduce(2.5) == 2.5
        reduced = rt.all_reduce({"a": 1, "b": torch.tensor([1.0, 3.0])}, op="sum")
        assert reduced["a"] == 1.0 and torch.equal(reduced["b"], torch.tensor([1.0, 3.0]))
        assert torch.equal(rt.gather_for_eval(torch.arange(6), 4), torch.arange(4))
        loader = rt.dataloader(list(range(7)), batch_size=3)
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]
        assert next(iter(loader)).device.type == expected
        rt.print("hello", 1)
        rt.print("to", "stderr", sep="-", file=sys.stderr, flush=True)  # print's keywords
        assert not rt.progress(range(2)).disable
        rt.barrier()
        with pytest.raises(ValueError, match=r"op must be one of .*'mean'.*got 'avg'"):
            rt.all_reduce(1.0, op="avg")
        with pytest.raises(TypeError, match="metric 'acc' is a str"):
            rt.all_reduce({"loss": 1.0, "acc": "n/a"})
        assert rt.all_reduce(np.float32(0.5)) == 0.5
        with pytest.raises(TypeError, match="got a dict: gather each entry"):
            rt.gather_for_eval({"logits": torch.zeros(4, 2)}, 4)
        with pytest.raises(ValueError, match="got 3 rows per rank, but 4 samples"):
            rt.gather_for_eval(torch.zeros(3), 4)
    with pytest.raises(RuntimeError, match=r"Runtime.all_reduce\(\) after the job was left"):
        rt.all_reduce(1.0)  # torch's "Default process group has not been initialized" before
    with pytest.raises(RuntimeError, match=r"Runtime.barrier\(\) after the job was left"):
        rt.barrier()
    assert not dist.is_initialized()
    captured = capsys.readouterr()
    assert captured.out == "hello 1\n" and captured.err.startswith("to-stderr\n")


def test_runtime_leaves_a_group_it_did_not_create():
    lockstep.init_distributed()
    try:
        with lockstep.Runtime() as rt:
            assert rt.world_size == 1
        assert dist.is_initialized()
    finally:
        lockstep.shutdown_distributed()


def test_move_to_device_keeps_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(1), (torch.zeros(2), "label")], "p": Pair(torch.ones(1), 3)}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][1] == "label"
    assert isinstance(moved["a"][1], tuple) and isinstance(moved["p"], Pair)
    assert moved["p"].x.device.type == "meta" and moved["p"].y == 3


def test_loader_state_counts_only_batches_the_loop_received():
    loader = ShardedLoader(list(range(40)), 2, rank=0, world_size=1, shuffle=True, num_workers=2)
    iterator = iter(loader)
    seen = [int(i) for _ in range(3) for i in next(iterator)]
    # Two worker processes have read ahead; the sampler counts only what the loop received
    # (it counted what was read until 2026-11-29), as the loader does.
    assert loader.sampler.consumed() == 6
    state = loader.state_dict()
    assert state == {"epoch": 0, "consumed": 6, "seed": 0, "num_replicas": 1, "pad_origin": 0,
                     "dataset_size": 40}
    del iterator
    resumed = ShardedLoader(list(range(40)), 2, rank=1, world_size=2, shuffle=True)
    resumed.load_state_dict(state)
    other = ShardedLoader(list(range(40)), 2, rank=0, world_size=2, shuffle=True)
    other.load_state_dict(state)
    rest = [int(i) for ld in (resumed, other) for b in ld for i in b]
    assert sorted(seen + rest) == list(range(40))


def test_loader_seeds_workers_apart_per_rank_and_reproducibly():
    def draws(rank: int) -> list[float]:
        loader = ShardedLoader(_Noise(), 2, rank=rank, world_size=2, num_workers=1, seed=3)
        return [float(v) for b in loader for v in b]

    assert draws(0) != draws(1)
    assert draws(0) == draws(0)


def test_loader_rejects_a_sampler():
    with pytest.raises(ValueError, match="chooses the sampler itself"):
        ShardedLoader(list(range(4)), 2, 0, 1, sampler=range(4))


# --- a world of two: the helper end to end ------------------------------------------------------


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(16, 5, generator=gen), torch.randn(16, 1, generator=gen))


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _helper_world(rank: int, device: str | None) -> dict:
    out: dict = {}
    with lockstep.Runtime(device=device) as rt:
        out["world"] = (rt.rank, rt.world_size)
        out["mean"] = rt.all_reduce(float(rank + 1))
        reduced = rt.all_reduce({"n": rank + 1, "t": torch.tensor([rank, 10.0])}, op="sum")
        out["dict"] = (reduced["n"], reduced["t"].tolist(), reduced["t"].dtype)
        out["max"] = rt.all_reduce(torch.tensor(rank * 5.0), op="max").item()
        # Evaluation over 5 samples: rank 1's shard is padded with sample 0 again.
        evaluation = rt.dataloader(list(range(5)), batch_size=2)
        local = torch.cat([batch * 10 for batch in evaluation])
        out["local_eval"] = local.tolist()
        out["gathered"] = rt.gather_for_eval(local, 5).tolist()
        try:
            rt.gather_for_eval(torch.zeros(rank + 1), 5)
        except ValueError as exc:
            out["gather_error"] = str(exc)
        try:  # batch by batch: the last batch's padding could not be dropped
            rt.gather_for_eval(local[:1], 5)
        except ValueError as exc:
            out["batch_error"] = str(exc)
        out["partial"] = rt.gather_for_eval(local[:1], 2).tolist()  # part of a pass, said so
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rt.print("only rank 0")
        out["printed"] = printed.getvalue()
        out["bar_disabled"] = rt.progress(total=3).disable
        rt.barrier()
        out.update(_train_then_no_sync(rt))
    out["left"] = not dist.is_initialized()
    return out


def _train_then_no_sync(rt: lockstep.Runtime) -> dict:
    model = rt.wrap(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = rt.dataloader(_data(), batch_size=4, shuffle=True, seed=5)
    loader.set_epoch(1)
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    params = [p.tolist() for p in rt.unwrap(model).parameters()]
    # no_sync: a local gradient stays local; the next synchronised backward averages both.
    x = torch.full((1, 5), float(rt.rank), device=rt.device)
    with rt.no_sync(model):
        model(x).sum().backward()
    unsynced = [p.grad.sum().item() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    synced = [p.grad.sum().item() for p in model.parameters()]
    return {
        "unsynced": unsynced,
        "synced": synced,
        "wrapped": type(model).__name__,
        "bare": type(rt.unwrap(model)).__name__,
        # Plain lists: tensors would travel back through shared memory that dies with the worker.
        "params": params,
    }


def _epoch_order(rank: int) -> list[int]:
    sampler = lockstep.DistributedSampler(range(16), 2, rank, shuffle=True, seed=5)
    sampler.set_epoch(1)
    return list(sampler)


@pytest.mark.multirank
def test_helper_in_a_world_of_two_matches_a_single_process():
    _check_world_of_two("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_helper_in_a_world_of_two_gpus_matches_a_single_process():
    _check_world_of_two(None)  # each rank on its GPU, NCCL


def _check_world_of_two(device: str | None) -> None:
    results = lockstep.spawn(_helper_world, 2, args=(device,), timeout=120)
    for rank, out in enumerate(results):
        assert out["world"] == (rank, 2) and out["left"]
        assert out["mean"] == 1.5
        assert out["dict"] == (3.0, [1.0, 20.0], torch.float32)
        assert out["max"] == 5.0
        assert out["gathered"] == [0, 10, 20, 30, 40]  # dataset order, the padded 0 dropped
        assert "same shape on every rank, got [(1,), (2,)]" in out["gather_error"]
        assert "got 1 row per rank, but 5 samples over 2 ranks" in out["batch_error"]
        assert out["partial"] == [0, 10]
        assert out["printed"] == ("only rank 0\n" if rank == 0 else "")
        assert out["bar_disabled"] == (rank != 0)
        assert (out["wrapped"], out["bare"]) == ("DistributedDataParallel", "Sequential")
    assert results[1]["local_eval"] == [10, 30, 0]
    assert results[0]["unsynced"] != results[1]["unsynced"]
    assert results[0]["synced"] == pytest.approx(results[1]["synced"])

    # Single-process reference: each step's batch is the union of both ranks' batches.
    x, y = _data().tensors
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    order0, order1 = (_epoch_order(rank) for rank in range(2))
    for step in range(2):
        batch = order0[4 * step : 4 * step + 4] + order1[4 * step : 4 * step + 4]
        loss = F.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for ours in (results[0]["params"], results[1]["params"]):
        for got, want in zip(ours, model.parameters()):
            torch.testing.assert_close(torch.tensor(got), want.detach(), rtol=1e-5, atol=1e-6)
