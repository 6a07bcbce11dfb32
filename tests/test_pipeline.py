"""Pipeline with every stage in this process (CPU devices): equal to the unsplit model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lockstep
from lockstep.pipeline.schedule import in_flight_peaks

CPUS3 = ["cpu", "cpu", "cpu"]

# torch sets TORCHINDUCTOR_CACHE_DIR when the first optimizer is built; build one at import so
# the conftest's environment check does not blame the first test.
torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
        nn.Tanh(), nn.Linear(16, 3),
    )


def _batches(n: int = 3, size: int = 10):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("chunks", [1, 4])  # 4 cuts a batch of 10 into 3, 3, 2, 2
def test_training_equals_the_unsplit_model(schedule, chunks):
    reference, model = _mlp(), _mlp()
    pipe = lockstep.Pipeline(model, chunks, schedule=schedule, loss_fn=F.mse_loss, devices=CPUS3)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches():
        ref_opt.zero_grad(), opt.zero_grad()
        ref_out = reference(x)
        ref_loss = F.mse_loss(ref_out, y)
        ref_loss.backward()
        losses = []
        out = pipe.step(x, target=y, losses=losses)
        torch.testing.assert_close(out, ref_out.detach())
        sizes = [len(t) for t in torch.tensor_split(y, chunks)]
        assert len(losses) == chunks
        assert sum(l.item() * n for l, n in zip(losses, sizes)) / len(y) == pytest.approx(
            ref_loss.item(), rel=1e-5)
        for (name, a), b in zip(reference.named_parameters(), pipe.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=name)
        ref_opt.step(), opt.step()
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(pipe(x), reference(x))


class _Shift(nn.Module):
    """A layer with a buffer that it updates in training, like BatchNorm's running mean."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1, 1, width))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
        return x + self.offset


def test_without_a_target_uneven_micro_batches_are_weighted_by_their_size():
    reference, model = _mlp(), _mlp()
    pipe = lockstep.Pipeline(model, 4, loss_fn=lambda out: out.square().mean(), devices=CPUS3)
    x, _ = _batches(1)[0]  # 10 samples: micro-batches of 3, 3, 2 and 2
    reference(x).square().mean().backward()
    pipe.step(x)
    for ours, theirs in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_buffers_update_as_in_the_unsplit_model_run_on_the_same_micro_batches():
    def build():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), _Shift(8),
                             nn.Linear(8, 3))

    reference, model = build(), build()
    pipe = lockstep.Pipeline(model, 2, loss_fn=F.mse_loss, devices=["cpu", "cpu"],
                             balance=[2, 3])
    for x, y in _batches(2, 8):
        for xs, ys in zip(x.chunk(2), y.chunk(2)):  # BatchNorm sees micro-batches in a pipeline
            (F.mse_loss(reference(xs), ys) / 2).backward()
        pipe.step(x, target=y)
    for (name, a), b in zip(reference.state_dict().items(), pipe.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name)
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert int(model[3].seen) == 16
    reference.eval(), pipe.eval()
    x = torch.randn(4, 6)
    torch.testing.assert_close(pipe(x), reference(x))


class _Split(nn.Module):
    def forward(self, x):
        mask = (x[:, :1] > 0).long()  # an integer tensor rides along, without gradient
        return torch.tanh(x), x * 2, mask


class _Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, a, b, mask):
        return self.proj(a + b) * mask, b.sum(dim=1)


def _tuple_loss(outputs, target):
    y, extra = outputs
    return F.mse_loss(y, target) + 0.1 * extra.pow(2).mean()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_passing_tuples_with_an_integer_tensor(schedule):
    def build():
        torch.manual_seed(4)
        return [nn.Sequential(nn.Linear(6, 6), _Split()), _Merge()]

    reference, stages = build(), build()
    pipe = lockstep.Pipeline(stages, 3, schedule=schedule, loss_fn=_tuple_loss,
                             devices=["cpu", "cpu"])
    x, y = _batches(1, 9)[0]
    out = pipe.step(x, target=y)
    ref_out = reference[1](*reference[0](x))
    _tuple_loss(ref_out, y).backward()
    torch.testing.assert_close(out[0], ref_out[0].detach())
    torch.testing.assert_close(out[1], ref_out[1].detach())
    ref_params = [p for s in reference for p in s.parameters()]
    for a, b in zip(ref_params, pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


class _WithMask(nn.Module):
    def forward(self, x):
        return x, (x[:, 0] > 0).long()


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, inp):  # takes the (hidden, mask) tuple as one argument, as in a Sequential
        h, mask = inp
        return torch.tanh(self.lin(h)) * mask.unsqueeze(1).to(h.dtype), mask


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, inp):
        return self.lin(inp[0])


@pytest.mark.parametrize("balance", [[1, 3], [2, 2], [3, 1]])
def test_a_sequential_whose_layers_pass_tuples_is_cut_anywhere(balance):
    # The layer after a cut gets the tuple the layer before returned, as inside the model
    # (it was given the tuple's tensors as separate arguments, and failed).
    def build():
        torch.manual_seed(5)
        return nn.Sequential(_WithMask(), _Masked(), _Masked(), _Head())

    reference, model = build(), build()
    pipe = lockstep.Pipeline(model, 2, loss_fn=F.mse_loss, devices=["cpu", "cpu"], balance=balance)
    x, y = _batches(1, 8)[0]
    out = pipe.step(x, target=y)
    ref_out = reference(x)
    F.mse_loss(ref_out, y).backward()
    torch.testing.assert_close(out, ref_out.detach())
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert set(pipe.state_dict()) == {f"stages.{i}.{k}" for i, n in enumerate(balance)
                                      for k in reference.state_dict() if int(k[0]) in
                                      range(sum(balance[:i]), sum(balance[:i + 1]))}


def test_activation_memory_follows_the_schedule():
    peaks = {}
    for schedule in ["gpipe", "1f1b"]:
        pipe = lockstep.Pipeline(_mlp(), 8, schedule=schedule, loss_fn=F.mse_loss,
                                 devices=["cpu"] * 4, balance=[2, 2, 2, 1])
        x, y = torch.randn(16, 6), torch.randn(16, 3)
        pipe.step(x, target=y)
        per_mb = [s.activation_bytes[0] for s in pipe.stats]
        assert all(b > 0 for b in per_mb)
        assert all(set(s.activation_bytes.values()) == {b} for s, b in zip(pipe.stats, per_mb))
        expected = [n * b for n, b in zip(in_flight_peaks(pipe.schedule()), per_mb)]
        peaks[schedule] = [s.peak_activation_bytes for s in pipe.stats]
        assert peaks[schedule] == expected
        assert [e[0] for e in pipe.stats[0].events].count("B0") == 1
    assert peaks["1f1b"][0] * 2 == peaks["gpipe"][0]  # 4 of 8 micro-batches in flight


def test_balance_by_time_and_printable_schedule():
    pipe = lockstep.Pipeline(_mlp(), 2, loss_fn=F.mse_loss, devices=["cpu", "cpu"],
                             balance="time", sample_input=torch.randn(4, 6))
    assert sum(len(s) for s in pipe.stages) == 7
    from lockstep.pipeline.schedule import format_schedule

    assert format_schedule(pipe.schedule()) == (
        "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1"
    )


def test_chunks_must_be_an_int():
    with pytest.raises(TypeError, match="chunks must be an int .micro-batches per batch., got 2.0"):
        lockstep.Pipeline(_mlp(), 2.0, loss_fn=F.mse_loss, devices=["cpu", "cpu"])  # type: ignore[arg-type]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="cannot split 7 layers into 8 stages"):
        lockstep.Pipeline(_mlp(), 2, devices=["cpu"] * 8)
    bad = nn.Sequential(nn.Linear(6, 16), nn.Linear(12, 3))
    pipe = lockstep.Pipeline(bad, 2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match=r"stage 1 failed in forward on micro-batch 0 with "
                       r"inputs of shapes \[\(2, 16\)\] from stage 0.*stage boundary is wrong"):
        pipe.step(torch.randn(4, 6), target=torch.randn(4, 3))

    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("a check of the user's own")

    pipe = lockstep.Pipeline([nn.Linear(6, 6), Raises()], 2, loss_fn=F.mse_loss, devices=["cpu"] * 2)
    with pytest.raises(RuntimeError, match="ValueError: a check of the user's own") as info:
        pipe.step(torch.randn(4, 6), target=torch.randn(4, 6))
    assert "stage boundary" not in str(info.value)  # said of any error until 2026-11-29
    pipe = lockstep.Pipeline(_mlp(), 2, loss_fn=F.cross_entropy, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="the target has 5 samples and the input 4"):
        pipe.step(torch.randn(4, 6), target=torch.randint(0, 3, (5,)))
    with pytest.raises(RuntimeError, match=r"stage 1 \(the last\): loss_fn failed on outputs of "
                       r"shapes \[\(2, 3\)\] and a target of shape \(2, 3\)"):
        pipe.step(torch.randn(4, 6), target=torch.randint(0, 3, (4, 3)))
    pipe = lockstep.Pipeline(_mlp(), 5, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="cannot cut a batch of 4 samples .* into 5 micro-batches"):
        pipe.step(torch.randn(4, 6), target=torch.randn(4, 3))
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        lockstep.Pipeline(_mlp(), 0, devices=["cpu"])
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'"):
        lockstep.Pipeline(_mlp(), 2, schedule="interleaved", devices=["cpu"])
    with pytest.raises(RuntimeError, match="needs loss_fn"):
        lockstep.Pipeline(_mlp(), 2, devices=["cpu"]).step(torch.randn(4, 6))
    with pytest.raises(RuntimeError, match="outside torch.no_grad"), torch.no_grad():
        pipe.step(torch.randn(8, 6), target=torch.randn(8, 3))
    with pytest.raises(RuntimeError, match="needs a process group"):
        lockstep.Pipeline(_mlp(), 2)
    with pytest.raises(ValueError, match="loss_fn must return a single-element tensor"):
        lockstep.Pipeline(_mlp(), 2, loss_fn=lambda o, t: o - t, devices=["cpu"]).step(
            torch.randn(4, 6), target=torch.randn(4, 3))
    with pytest.raises(TypeError, match="pipeline stage 1's output must be a tensor or a tuple"):
        lockstep.Pipeline([nn.Linear(6, 2), nn.Flatten(0)][:1] + [_Dict()], 1, loss_fn=F.mse_loss,
                          devices=["cpu", "cpu"]).step(torch.randn(2, 6), target=torch.randn(2))


def test_one_stage_per_rank_in_a_world_of_one():
    lockstep.init_distributed()  # an in-memory world of one: the rank path, no processes
    try:
        reference = _mlp()
        pipe = lockstep.Pipeline(_mlp(), 4, loss_fn=F.mse_loss)
        assert pipe.is_distributed and pipe.num_stages == 1
        x, y = _batches(1)[0]
        F.mse_loss(reference(x), y).backward()
        losses: list = []
        torch.testing.assert_close(pipe.step(x, target=y, losses=losses), reference(x).detach())
        assert len(losses) == 4
        for a, b in zip(reference.parameters(), pipe.parameters()):
            torch.testing.assert_close(b.grad, a.grad)
        torch.testing.assert_close(pipe(x), reference(x))
        pipe.stage = lockstep.DistributedDataParallel(pipe.stage)
        pipe.step(x, target=y)  # lockstep's DDP: armed for the last micro-batch
        pipe.stage = nn.parallel.DistributedDataParallel(pipe.stage.module)
        with pytest.raises(RuntimeError, match="wrapped in DistributedDataParallel, which has "
                           "no_sync.* wrap the stage in lockstep.DistributedDataParallel"):
            pipe.step(x, target=y)
    finally:
        lockstep.shutdown_distributed()


class _Dict(nn.Module):
    def forward(self, x):
        return {"y": x}


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_equals_the_unsplit_model_on_gpus(schedule):
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(3)]
    reference = _mlp().to(devices[0])
    pipe = lockstep.Pipeline(_mlp(), 4, schedule=schedule, loss_fn=F.mse_loss, devices=devices)
    x, y = (t.to(devices[0]) for t in _batches(1)[0])
    F.mse_loss(reference(x), y).backward()
    out = pipe.step(x, target=y.to(devices[-1]))
    torch.testing.assert_close(out.to(devices[0]), reference(x).detach())
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(b.grad.to(devices[0]), a.grad)


def test_a_batch_that_requires_grad_gets_its_gradient_without_warnings():
    """The first stage's inputs are views of the batch: reading their .grad warned on every
    step (until 2026-11-29); the batch's own gradient is that of one backward over it."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = lockstep.Pipeline(model, chunks=3, devices=["cpu", "cpu"], loss_fn=F.mse_loss)
    x, y = torch.randn(6, 4, requires_grad=True), torch.randn(6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, target=y)
    ref = x.detach().clone().requires_grad_(True)
    F.mse_loss(model(ref), y).backward()
    torch.testing.assert_close(x.grad, ref.grad)
