"""Pipeline with one stage per rank on gloo/CPU, alone and combined with DDP replicas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import lockstep
from lockstep.ddp.comm_hooks import allreduce_hook

pytestmark = pytest.mark.multirank

STEPS = 2

# torch sets TORCHINDUCTOR_CACHE_DIR when the first optimizer is built; build one at import so
# the conftest's environment check does not blame the first test.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


def _plain(value):
    """Tensors as nested lists: a worker's tensors cannot outlive it on the way back."""
    if torch.is_tensor(value):
        return ("tensor", value.tolist())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tensors(value):
    """Undo :func:`_plain`."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
        return torch.tensor(value[1])
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    return value


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Tanh(),
        nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3),
    )


def _data(batch: int = 12):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g))
            for _ in range(STEPS)]


class _Split(nn.Module):
    def forward(self, x):
        return torch.tanh(x), x * 2, (x[:, :1] > 0).long()


class _Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, a, b, mask):
        return self.proj(a + b) * mask


def _tuple_stages() -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Sequential(nn.Linear(6, 6), _Split()), _Merge()]


def _train(pipe, stage: int, last: int, data) -> list:
    """Run STEPS steps as stage ``stage``; return the last stage's outputs and losses per step."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    outputs = []
    for x, y in data:
        opt.zero_grad()
        losses: list = []
        out = pipe.step(*((x,) if stage == 0 else ()), target=y if stage == last else None,
                        losses=losses)
        outputs.append((out, [l.item() for l in losses]))
        opt.step()
    return outputs


def _stage_state(pipe) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.stage.state_dict().items()}


def _three_stage_world(rank: int) -> dict:
    lockstep.init_distributed()
    results: dict = {}
    for schedule in ["gpipe", "1f1b"]:
        pipe = lockstep.Pipeline(_mlp(), 4, schedule=schedule, loss_fn=F.mse_loss)
        results[schedule] = (_train(pipe, rank, 2, _data()), _stage_state(pipe))
        results[schedule + "_peak"] = pipe.stats[0].peak_activation_bytes
        pipe.eval()
        results[schedule + "_eval"] = pipe(*((_data()[0][0],) if rank == 0 else ()))
    # balance="time": rank 0 times the layers and every rank cuts at the same places.
    pipe = lockstep.Pipeline(_mlp(), 2, loss_fn=F.mse_loss, balance="time",
                             sample_input=torch.randn(4, 6))
    results["time_split"] = list(pipe.stage.state_dict())
    # Explicit stages passing a tuple (with an integer tensor) over a two-rank subgroup.
    group = dist.new_group([0, 1])
    if rank < 2:
        pipe = lockstep.Pipeline(_tuple_stages(), 3, loss_fn=F.mse_loss, process_group=group)
        results["tuple"] = (_train(pipe, rank, 1, _data(9)), _stage_state(pipe))
    if rank == 0:  # raises before sending anything, so the world stays in step
        pipe = lockstep.Pipeline(_mlp(), 4, loss_fn=F.mse_loss)
        try:
            pipe.step(torch.randn(3, 6))
        except ValueError as exc:
            results["error"] = str(exc)
    dist.barrier()
    return _plain(results)


def _reference(model_or_stages, chunks: int, data, loss_fn=F.mse_loss):
    """Single-process training on the same micro-batches: outputs, losses, final state."""
    if isinstance(model_or_stages, list):
        model = nn.Sequential(*model_or_stages)
        forward = lambda x: model[1](*model[0](x))
    else:
        model = forward = model_or_stages
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for x, y in data:
        opt.zero_grad()
        outs, losses = [], []
        for xs, ys in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
            out = forward(xs)
            loss = loss_fn(out, ys)
            (loss * len(xs) / len(x)).backward()
            outs.append(out.detach())
            losses.append(loss.item())
        history.append((torch.cat(outs), losses))
        opt.step()
    return history, model.state_dict()


def _check_history(got, expected):
    for (out, losses), (ref_out, ref_losses) in zip(got, expected):
        torch.testing.assert_close(out, ref_out)
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_three_ranks_equal_one_process_for_both_schedules_with_buffers_and_tuples():
    results = _tensors(lockstep.spawn(_three_stage_world, 3, timeout=120))
    history, state = _reference(_mlp(), 4, _data())
    for schedule in ["gpipe", "1f1b"]:
        assert results[0][schedule][0][0] == (None, [])
        _check_history(results[2][schedule][0], history)
        merged = {k: v for r in results for k, v in r[schedule][1].items()}
        assert sorted(merged) == sorted(state)  # every layer on exactly one rank, same names
        for name, value in state.items():
            torch.testing.assert_close(merged[name], value, msg=name)
    model = _mlp()
    model.load_state_dict(state)
    model.eval()
    for schedule in ["gpipe", "1f1b"]:
        assert results[0][schedule + "_eval"] is None
        torch.testing.assert_close(results[2][schedule + "_eval"], model(_data()[0][0]))
    # Stage 0 holds 4 micro-batches in GPipe, p - 0 = 3 in 1F1B.
    assert results[0]["gpipe_peak"] * 3 == results[0]["1f1b_peak"] * 4
    assert results[2]["gpipe_peak"] == results[2]["1f1b_peak"] * 4

    names = [n for r in results for n in r["time_split"]]
    assert sorted(names) == sorted(state)  # the ranks agreed: no layer twice, none missing

    history, state = _reference(_tuple_stages(), 3, _data(9))
    _check_history(results[1]["tuple"][0], history)
    merged = {f"{i}.{k}": v for i in range(2) for k, v in results[i]["tuple"][1].items()}
    for name, value in state.items():
        torch.testing.assert_close(merged[name], value, msg=name)
    assert "cannot cut a batch of 3 samples (input 0) into 4 micro-batches" in results[0]["error"]


def _bad_boundary(rank: int) -> None:
    lockstep.init_distributed()
    model = nn.Sequential(nn.Linear(6, 16), nn.Linear(12, 3))
    pipe = lockstep.Pipeline(model, 2, loss_fn=F.mse_loss)
    pipe.step(*((torch.randn(4, 6),) if rank == 0 else ()),
              target=torch.randn(4, 3) if rank == 1 else None)


def test_a_stage_boundary_whose_shapes_do_not_match_names_the_stage():
    with pytest.raises(lockstep.WorkerError) as info:
        lockstep.spawn(_bad_boundary, 2, timeout=60)
    assert info.value.rank == 1
    assert "stage 1 failed in forward on micro-batch 0 with inputs of shapes [(2, 16)]" in str(
        info.value)


def _counting_allreduce(state: tuple, bucket):
    counter, group = state
    counter.append(bucket.index())
    return allreduce_hook(group, bucket)


def _pipeline_times_data_parallel(rank: int) -> dict:
    """Ranks 0,1 and 2,3 are two pipelines; ranks 0,2 and 1,3 replicate a stage."""
    lockstep.init_distributed()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    results = {}
    for schedule in ["gpipe", "1f1b"]:
        pipe = lockstep.Pipeline(_mlp(), 3, schedule=schedule, loss_fn=F.mse_loss,
                                 process_group=pipelines[replica])
        pipe.stage = lockstep.DistributedDataParallel(pipe.stage, process_group=replicas[stage])
        counter: list = []
        pipe.stage.register_comm_hook((counter, replicas[stage]), _counting_allreduce)
        # Each replica trains on its half of every batch.
        data = [(x.chunk(2)[replica], y.chunk(2)[replica]) for x, y in _data()]
        _train(pipe, stage, 1, data)
        state = {k: v.detach().clone() for k, v in pipe.stage.module.state_dict().items()}
        grads = {n: p.grad.clone() for n, p in pipe.stage.module.named_parameters()}
        results[schedule] = (state, grads, len(counter))
    return _plain(results)


def test_two_stages_times_two_replicas_equal_one_process_on_the_whole_batch():
    results = _tensors(lockstep.spawn(_pipeline_times_data_parallel, 4, timeout=120))
    # BatchNorm normalises per micro-batch of a replica: 3 micro-batches of each half-batch.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data():
        opt.zero_grad()
        for xh, yh in zip(x.chunk(2), y.chunk(2)):
            for xs, ys in zip(torch.tensor_split(xh, 3), torch.tensor_split(yh, 3)):
                (F.mse_loss(model(xs), ys) * len(xs) / len(x)).backward()
        opt.step()
    params = dict(model.named_parameters())
    for schedule in ["gpipe", "1f1b"]:
        for stage in range(2):
            for rank in (stage, stage + 2):  # both replicas end identical to the reference
                state, grads, syncs = results[rank][schedule]
                assert syncs == STEPS  # one bucket, synced once per step, not per micro-batch
                for name, grad in grads.items():
                    torch.testing.assert_close(grad, params[name].grad, msg=name)
                for name, value in state.items():
                    if "running" not in name and "num_batches" not in name:
                        torch.testing.assert_close(value, model.state_dict()[name], msg=name)


def _two_gpu_world(rank: int) -> dict:
    info = lockstep.init_distributed(device=f"cuda:{rank}")  # NCCL, one GPU per rank
    results = {}
    for schedule in ["gpipe", "1f1b"]:
        pipe = lockstep.Pipeline(_mlp(), 4, schedule=schedule, loss_fn=F.mse_loss)
        assert next(pipe.parameters()).device == info.device
        data = [(x.to(info.device), y.to(info.device)) for x, y in _data()]
        history = [(out.cpu() if out is not None else None, losses)
                   for out, losses in _train(pipe, rank, 1, data)]
        state = {k: v.cpu() for k, v in _stage_state(pipe).items()}
        results[schedule] = (history, state)
    return _plain(results)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_equal_one_process():
    results = _tensors(lockstep.spawn(_two_gpu_world, 2, timeout=120))
    history, state = _reference(_mlp(), 4, _data())
    for schedule in ["gpipe", "1f1b"]:
        _check_history(results[1][schedule][0], history)
        merged = {k: v for r in results for k, v in r[schedule][1].items()}
        for name, value in state.items():
            torch.testing.assert_close(merged[name], value, msg=name, rtol=1e-4, atol=1e-4)


def _checkpointed_world(rank: int, directory: str) -> dict:
    """Two identical-looking stages (nothing fails if rank 0's is restored on both), Adam, the
    Checkpointer's default (asynchronous) save; then a restore into a fresh pipeline."""
    lockstep.init_distributed()
    data = [(x[:, :4], x[:, 2:].cos()) for x, _ in _data()] * 2

    def build():
        torch.manual_seed(rank)
        pipe = lockstep.Pipeline([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)], 2,
                                 loss_fn=F.mse_loss)
        return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01)

    def train(pipe, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            pipe.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
            opt.step()
        return {k: v.detach().clone() for k, v in pipe.state_dict().items()}

    ckpt = lockstep.Checkpointer(directory)
    pipe, opt = build()
    train(pipe, opt, data[:2])
    try:
        ckpt.save(2, model=pipe, optimizer=opt)
    except lockstep.CheckpointError as exc:
        refused = str(exc)
    ckpt.save(2, model=pipe, optimizer=pipe.optimizer_state(opt))
    ckpt.wait()
    went_on = train(pipe, opt, data[2:])
    fresh, fresh_opt = build()
    ckpt.restore(model=fresh, optimizer=fresh.optimizer_state(fresh_opt))
    resumed = train(fresh, fresh_opt, data[2:])
    groups = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    alone = lockstep.Pipeline([nn.Linear(4, 4)], 1, loss_fn=F.mse_loss, process_group=groups[rank])
    try:
        lockstep.Checkpointer(directory).restore(model=alone)
    except lockstep.CheckpointError as exc:
        other_stages = str(exc)
    return _plain({"went_on": went_on, "resumed": resumed, "refused": refused,
                   "other_stages": other_stages})


def test_each_rank_saves_and_restores_its_own_stage(tmp_path):
    results = _tensors(lockstep.spawn(_checkpointed_world, 2, args=(str(tmp_path),), timeout=120))
    assert "Pass optimizer=pipe.optimizer_state(optimizer) instead" in results[0]["refused"]
    assert "pipeline stage 0" in results[1]["refused"]  # rank 0's error, on every rank
    for rank in range(2):
        went_on, resumed = results[rank]["went_on"], results[rank]["resumed"]
        for name, value in went_on.items():
            assert torch.equal(resumed[name], value), (rank, name)
        assert "holds no stage 0 of a 1-stage pipeline" in results[rank]["other_stages"]
        assert "saved by a pipeline of [2] stage(s)" in results[rank]["other_stages"]
    assert not torch.equal(results[0]["went_on"]["stages.0.0.weight"],
                           results[1]["went_on"]["stages.0.0.weight"])


def _sends_and_no_sync(rank: int) -> dict:
    """Eight micro-batches through two stages under 1F1B: what each rank holds in sends in
    flight; then a step inside the user's no_sync() (a 1-stage pipeline per rank, its stage in
    DDP over both ranks) and a synced one."""
    lockstep.init_distributed()
    torch.manual_seed(0)
    pipe = lockstep.Pipeline([nn.Linear(64, 64), nn.Linear(64, 64)], 8, loss_fn=F.mse_loss)
    x, y = torch.randn(8 * 16, 64), torch.randn(8 * 16, 64)
    pipe.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    sent = pipe.stats[0].peak_sent_bytes
    groups = [dist.new_group([r]) for r in range(2)]
    alone = lockstep.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), 3,
                              loss_fn=F.mse_loss, process_group=groups[rank])
    alone.stage = lockstep.DistributedDataParallel(alone.stage)
    calls: list = []
    alone.stage.register_comm_hook((calls, None), _counting_allreduce)
    with alone.stage.no_sync():
        alone.step(torch.randn(6, 4), target=torch.randn(6, 2))
    in_no_sync = len(calls)
    alone.step(torch.randn(6, 4), target=torch.randn(6, 2))
    return {"sent": sent, "in_no_sync": in_no_sync, "after": len(calls)}


def test_sends_are_freed_once_taken_and_the_users_no_sync_holds():
    results = lockstep.spawn(_sends_and_no_sync, 2, timeout=120)
    micro_batch = 16 * 64 * 4  # one micro-batch's activation (rank 0) or gradient (rank 1)
    for rank in range(2):
        # Until 2026-11-29 every send stayed until the step's end: 8 micro-batches.
        assert 0 < results[rank]["sent"] <= 2 * micro_batch + 256, results[rank]
        assert results[rank]["in_no_sync"] == 0 and results[rank]["after"] == 1, results[rank]
