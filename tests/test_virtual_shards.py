"""Tests of the virtual-shard mode (lockstep.ddp.virtual_shards, shard_tree, virtual_sampler).

Tiers: tree and sampler arithmetic, errors and a world of one in this process (against plain
full-batch training); worlds of 1, 2 and 4 on gloo through ``lockstep.spawn``, which must agree
bitwise (``torch.equal``) on every parameter, buffer and optimizer state after 50 steps, also
across a save at world 2 and a resume at worlds 1 and 4.
"""

from __future__ import annotations

import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.ddp.shard_tree import TreeSum, check_virtual_shards, tree_sum
from lockstep.ddp.virtual_shards import VirtualShardDDP, shard_seed, split_shards
from lockstep.virtual_sampler import VirtualShardSampler

V = 4  # virtual shards
SHARD = 2  # samples per shard
STEPS = 50
SAVE_AT = 25  # mid-epoch: 64 samples / 8 per step = 8 steps an epoch


# -- shared bodies (module level: spawned workers import them) -------------------------------


class TinyGPT(nn.Module):
    """A demo-like model: embedding, one transformer block with dropout, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


class ConvNet(nn.Module):
    """A ResNet-style convnet: conv, a residual block with BatchNorm, dropout, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                   nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(4 * 6 * 6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(F.relu(h + self.block(h)))


def _setup(kind: str) -> tuple[nn.Module, TensorDataset, Any]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "gpt":
        tokens = torch.randint(0, 16, (64, 7), generator=gen)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            return F.cross_entropy(m(b[0]).reshape(-1, 16), b[1].reshape(-1))

        return TinyGPT(), data, loss
    data = TensorDataset(torch.randn(64, 3, 6, 6, generator=gen),
                         torch.randint(0, 5, (64,), generator=gen))
    return ConvNet(), data, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def _train(kind: str, directory: Path | None, resume: bool, save: bool,
           bucket_cap_mb: float = 25.0) -> dict[str, Any]:
    """Train ``kind`` to STEPS; optionally resume from / save at SAVE_AT in ``directory``."""
    module, data, loss_fn = _setup(kind)
    model = VirtualShardDDP(module, V, seed=7, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = VirtualShardSampler(data, V, SHARD, seed=3)
    ckpt = lockstep.Checkpointer(directory) if directory is not None else None
    step = 0
    if resume:
        assert ckpt is not None
        restored = ckpt.restore(model=model, optimizer=opt, sampler=sampler)
        assert restored is not None
        step = restored.step
    per_epoch = len(data) // (V * SHARD)
    losses = []
    while step < STEPS:
        sampler.set_epoch(step // per_epoch)
        for batch in DataLoader(data, batch_sampler=sampler):
            losses.append(model.train_step(split_shards(batch, model.shards_per_rank), loss_fn,
                                           step))
            opt.step()
            step += 1
            if save and step == SAVE_AT:
                assert ckpt is not None
                ckpt.save(step, model=model, optimizer=opt, sampler=sampler)
            if step == STEPS:
                break
    state = [t.clone() for t in [*module.parameters(), *module.buffers()]]
    for per_param in opt.state_dict()["state"].values():
        state += [torch.as_tensor(v).clone() for v in per_param.values()]
    return {"state": state, "losses": torch.stack(losses)}


def shards_worker(rank: int, directory: str, save: bool, resume: bool,
                  bucket_cap_mb: float) -> dict[str, Any]:
    lockstep.init_distributed()
    out = {}
    for kind in ("gpt", "conv"):
        where = Path(directory) / kind
        out[kind] = _train(kind, where, False, save, bucket_cap_mb)
        if resume:
            out[kind + "-resumed"] = _train(kind, where, True, False, bucket_cap_mb)
    dist.barrier()
    return out


# -- tier 1: arithmetic, errors, a world of one ----------------------------------------------


def test_tree_sum_streams_in_the_same_order():
    leaves = [torch.randn(5, dtype=torch.float32) * 10 ** i for i in range(8)]
    acc = TreeSum()
    for leaf in leaves:
        acc.push(leaf)
    assert torch.equal(acc.result(), tree_sum(leaves))
    # a rank's block is a subtree: the 4+4 split adds the same way
    assert torch.equal(tree_sum([tree_sum(leaves[:4]), tree_sum(leaves[4:])]), tree_sum(leaves))


@pytest.mark.parametrize("shards,world", [(4, 3), (6, 2), (4, 8)])
def test_world_that_cannot_run_the_shards_is_refused(shards, world):
    with pytest.raises(ValueError, match="virtual_shards"):
        check_virtual_shards(shards, world)
    with pytest.raises(ValueError, match="virtual_shards"):
        VirtualShardSampler(range(64), shards, 2, num_replicas=world, rank=0)


def test_sampler_membership_does_not_depend_on_the_world():
    def shards(world: int) -> list[list[int]]:
        out: list[list[int]] = []
        samplers = [VirtualShardSampler(range(40), 4, 3, world, r, seed=5) for r in range(world)]
        for batches in zip(*samplers):
            for batch in batches:
                out += [batch[i : i + 3] for i in range(0, len(batch), 3)]
        return out

    assert shards(1) == shards(2) == shards(4)
    assert len(shards(1)) == 4 * (40 // 12)


def test_sampler_resumes_at_another_world_and_refuses_another_run():
    first = VirtualShardSampler(range(40), 4, 2, 2, 0)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    assert state["steps"] == 2
    one = VirtualShardSampler(range(40), 4, 2, 1, 0)
    one.load_state_dict(state)
    assert next(iter(one))[:4] == list(VirtualShardSampler(range(40), 4, 2, 1, 0))[2][:4]
    with pytest.raises(ValueError, match="virtual_shards=4"):
        VirtualShardSampler(range(40), 8, 2, 1, 0).load_state_dict(state)


def test_a_save_at_the_top_of_an_epoch_resumes_the_whole_epoch():
    sampler = VirtualShardSampler(range(40), 4, 2, 2, 0)
    assert len(list(sampler)) == 5  # epoch 0 to its end
    sampler.set_epoch(1)
    state = sampler.state_dict()  # saved before the first batch of epoch 1
    assert (state["epoch"], state["steps"]) == (1, 0)
    resumed = VirtualShardSampler(range(40), 4, 2, 1, 0)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 5


def test_a_resumed_pass_counts_the_steps_it_skipped_to_its_end():
    # Saved after step 2, resumed; the state stays "steps of the epoch" after the resumed pass
    # is exhausted (a DataLoader reads ahead to the end), where it fell back to the pass's own
    # count before and a restore replayed the steps already done.
    first = VirtualShardSampler(range(40), 4, 2, 2, 0)
    it = iter(first)
    next(it), next(it)
    resumed = VirtualShardSampler(range(40), 4, 2, 4, 0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict()["steps"] == 2  # loaded, not yet iterated
    batches = list(resumed)  # the rest of the epoch, read ahead to its end
    assert len(batches) == 3 and resumed.state_dict()["steps"] == 5
    assert resumed.state_dict(steps=1)["steps"] == 3  # the loop used one of them
    again = VirtualShardSampler(range(40), 4, 2, 1, 0)
    again.load_state_dict(resumed.state_dict())
    assert list(again) == []  # nothing of epoch 0 is trained twice
    assert len(list(resumed)) == 5  # a second pass over the same epoch is whole


def test_split_shards_and_seeds():
    parts = split_shards((torch.arange(6), {"y": torch.arange(6) * 2}), 3)
    assert torch.equal(parts[1][0], torch.tensor([2, 3]))
    assert torch.equal(parts[2][1]["y"], torch.tensor([8, 10]))
    with pytest.raises(ValueError, match="5 samples"):
        split_shards(torch.zeros(5), 2)
    assert shard_seed(0, 1, 2) != shard_seed(0, 2, 1)
    # Per-sample plain values collated into a list go with their samples (each shard got all
    # of the rank's until 2026-11-29: what a shard saw depended on the world size); a constant
    # goes whole to every shard; a namedtuple keeps its type (a TypeError before).
    text = split_shards((torch.arange(4), ["a", "b", "c", "d"], ("cfg", 1)), 2)
    assert [part[1] for part in text] == [["a", "b"], ["c", "d"]]
    assert [part[2] for part in text] == [("cfg", 1), ("cfg", 1)]
    pair = namedtuple("pair", "x y")
    halves = split_shards(pair(torch.arange(4), torch.arange(4) * 3), 2)
    assert type(halves[1]) is pair and torch.equal(halves[1].y, torch.tensor([6, 9]))


class _Counter(nn.Module):
    """An integer buffer that depends on the data: it cannot be the same on every shard."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("positives", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.positives += (x[:, 0] > 0).sum()
        return self.lin(x)


def test_an_integer_buffer_that_depends_on_the_data_is_refused():
    # Until 2026-11-29 each rank kept its last shard's count: 11 at world 1, [7, 11] at 2.
    model = VirtualShardDDP(_Counter(), 2)
    x = torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [-1.0, 0, 0], [1.0, 0, 0]])
    with pytest.raises(ValueError, match="integer buffer 'positives' came out of virtual shard 1 "
                       "unlike the rank's first shard"):
        model.train_step(split_shards(x, 2), lambda m, b: m(b).sum(), 0)


def test_world_of_one_matches_full_batch_training():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    ours = VirtualShardDDP(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double(), 4)
    ours.module.load_state_dict(ref.state_dict())
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    F.mse_loss(ref(x), y).backward()
    loss = ours.train_step(split_shards((x, y), 4), lambda m, b: F.mse_loss(m(b[0]), b[1]), 0)
    assert torch.allclose(loss, F.mse_loss(ref(x), y), atol=1e-12)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-12)


def test_batchnorm_is_per_shard_and_rng_is_per_shard_and_restored():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model = VirtualShardDDP(net, 2, seed=5)
    x = torch.randn(8, 3)
    with torch.no_grad():
        h = net[0](x)
    shard_means = torch.stack([h[:4].mean(0), h[4:].mean(0)])
    outputs: list[torch.Tensor] = []

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b)
        outputs.append(out.detach())
        return out.sum()

    before = torch.get_rng_state()
    model.train_step(split_shards(x, 2), loss_fn, step=3)
    assert torch.equal(torch.get_rng_state(), before)  # each shard forks the generator
    # running_mean = momentum * (mean over shards of each shard's own batch mean)
    assert torch.allclose(net[1].running_mean, 0.1 * shard_means.mean(0), atol=1e-6)
    assert int(net[1].num_batches_tracked) == 1
    # the same step and shard draw the same dropout mask, another step another one
    again = VirtualShardDDP(net, 2, seed=5)
    net[1].reset_running_stats()
    again.train_step(split_shards(x, 2), loss_fn, step=3)
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
    again.train_step(split_shards(x, 2), loss_fn, step=4)
    assert not torch.equal(outputs[0], outputs[4])


class ReadsRank(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (dist.get_rank() + 1)


def test_forward_that_reads_the_rank_is_refused():
    model = VirtualShardDDP(ReadsRank(2, 2), 2)
    with pytest.raises(RuntimeError, match="virtual shard 0 .*read the rank"):
        model.train_step(split_shards(torch.zeros(2, 2), 2), lambda m, b: m(b).sum(), 0)
    assert dist.get_rank is not None and "refuse" not in dist.get_rank.__name__


def test_a_submodule_compiled_inside_a_shard_is_not_taken_for_reading_the_rank():
    # torch.compile compiles on the first call, inside the shard, and its logging reads the
    # rank: that is torch's own business, not the model's result.
    torch.manual_seed(0)
    net = nn.Sequential(torch.compile(nn.Linear(8, 8), backend="aot_eager"), nn.ReLU(), nn.Linear(8, 3))
    model = VirtualShardDDP(net, 2)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    loss = model.train_step(split_shards((x, y), 2),
                            lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), 0)
    assert torch.isfinite(loss).all()


def test_shard_size_must_be_an_int():
    with pytest.raises(TypeError, match="shard_size must be an int .samples per virtual shard., got 2.5"):
        VirtualShardSampler(range(40), 4, 2.5, 1, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "module,match",
    [
        (nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)), "SyncBatchNorm"),
        (nn.Embedding(4, 2, sparse=True), "sparse=True"),
        (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), "one dtype"),
    ],
)
def test_unsupported_modules_are_refused(module, match):
    with pytest.raises(ValueError, match=match):
        VirtualShardDDP(module, 2)


def test_wrong_number_of_shards_names_the_rank():
    model = VirtualShardDDP(nn.Linear(2, 2), 4)
    with pytest.raises(ValueError, match="rank 0 got 2 shards, but runs 4"):
        model.train_step(split_shards(torch.zeros(4, 2), 2), lambda m, b: m(b).sum(), 0)


def test_buckets_equal_the_flat_tree_when_the_last_shard_skips_a_layer(world_of_one):
    from lockstep.ddp.shard_buckets import ShardBuckets

    torch.manual_seed(0)
    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]

    def grads(x: torch.Tensor, use_b: bool) -> list[torch.Tensor]:
        h = a(x)
        out = c(b(h) if use_b else h).pow(2).mean()
        got = torch.autograd.grad(out, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]

    x0, x1 = torch.randn(4, 3), torch.randn(4, 3)
    flat = [torch.cat([g.reshape(-1) for g in grads(x, u)]) for x, u in ((x0, True), (x1, False))]
    expected = tree_sum(flat) * 0.5
    buckets = ShardBuckets(params, 5, 1)  # small buckets: b's sit between a's and c's
    assert len(buckets.buckets) == 3  # c, b, a: the middle one gets no last-shard gradient
    buckets.begin()
    buckets.push(grads(x0, True))
    handles = buckets.hooks()
    grads(x1, False)  # b gets no gradient: its bucket starts after backward, in order
    for handle in handles:
        handle.remove()
    buckets.finish(0.5)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), expected)


# -- tier 2: worlds 1, 2 and 4 agree bitwise -------------------------------------------------


def test_same_run_at_worlds_1_2_4_and_across_resume(tmp_path):
    saved = tmp_path / "saved"
    # World 2 reduces after backward in one piece; world 4 in ~100-element buckets overlapped
    # with the last shard's backward: no bit may depend on it.
    two = lockstep.spawn(shards_worker, 2, args=(str(saved), True, False, 0.0), timeout=240)
    others = {
        world: lockstep.spawn(shards_worker, world, args=(str(saved), False, True, cap),
                              timeout=240)
        for world, cap in ((1, 25.0), (4, 4e-4))
    }
    reference = two[0]
    for kind in ("gpt", "conv"):
        runs = [("world 2 rank 1", two[1][kind])]
        for world, results in others.items():
            for rank, result in enumerate(results):
                runs.append((f"world {world} rank {rank}", result[kind]))
                runs.append((f"world 2 -> {world} rank {rank}", result[kind + "-resumed"]))
        for name, run in runs:
            assert len(run["state"]) == len(reference[kind]["state"]), (kind, name)
            for i, (a, b) in enumerate(zip(reference[kind]["state"], run["state"])):
                assert torch.equal(a, b), f"{kind}: {name} differs from world 2 in tensor {i}"
        for world, results in others.items():
            assert torch.equal(results[0][kind]["losses"], reference[kind]["losses"]), (kind, world)


# -- the launcher carries V ------------------------------------------------------------------


def _plan(tmp_path: Path, *flags: str) -> Any:
    from lockstep.cli import build_parser
    from lockstep.launcher.launch_plan import plan_from_args

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    return plan_from_args(build_parser().parse_args(["run", *flags, str(script)]), environ={})


def test_launcher_passes_v_to_the_workers(tmp_path, monkeypatch):
    plan = _plan(tmp_path, "--nproc-per-node", "2", "--virtual-shards", "8")
    assert plan.worker_env["LOCKSTEP_VIRTUAL_SHARDS"] == "8"
    monkeypatch.setenv("LOCKSTEP_VIRTUAL_SHARDS", "8")
    assert VirtualShardDDP(nn.Linear(2, 2)).shards_per_rank == 8
    assert VirtualShardSampler(range(64), None, 2, 2, 1).shards_per_rank == 4


def test_plain_ddp_under_virtual_shards_says_it_does_not_use_them(world_of_one, monkeypatch):
    # Until 2026-11-29 `lockstep run --virtual-shards V` with a plain DDP script (the demo's
    # rt.wrap) ran as plain DDP without a word.
    monkeypatch.setenv("LOCKSTEP_VIRTUAL_SHARDS", "4")
    with pytest.warns(UserWarning, match=r"--virtual-shards 4`: this wrapper does not use "
                      r"virtual shards.*lockstep.VirtualShardDDP"):
        lockstep.DistributedDataParallel(nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        VirtualShardDDP(nn.Linear(2, 2))
    assert not [w for w in caught if "does not use virtual shards" in str(w.message)]


def test_launcher_refuses_a_world_that_cannot_run_v(tmp_path):
    with pytest.raises(ValueError, match="--virtual-shards 4: a world of 3 ranks"):
        _plan(tmp_path, "--nproc-per-node", "3", "--virtual-shards", "4")


def test_missing_v_says_how_to_give_it(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_VIRTUAL_SHARDS", raising=False)
    with pytest.raises(ValueError, match="lockstep run --virtual-shards V"):
        VirtualShardDDP(nn.Linear(2, 2))


def test_a_thread_count_other_world_sizes_would_not_have_is_warned(monkeypatch):
    """CPU sums' bits depend on the thread count: plain `python` on every core and a worker of
    `lockstep run --virtual-shards V` (cores // V threads) train different bits. A process
    whose count differs from that, with no OMP_NUM_THREADS chosen, is warned; one that matches,
    or where OMP_NUM_THREADS was set, is not."""
    import warnings

    from lockstep.env import threads_per_share

    want, before = threads_per_share(4), torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(want + 1)
        with pytest.warns(UserWarning, match=rf"computes on {want + 1} CPU threads.*OMP_NUM_THREADS={want}"):
            VirtualShardDDP(nn.Linear(2, 2), 4)
        monkeypatch.setenv("OMP_NUM_THREADS", str(want + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            VirtualShardDDP(nn.Linear(2, 2), 4)  # chosen by the user
        # Chosen by a launcher (lockstep run without --virtual-shards: cores // nproc; torchrun:
        # 1 for several workers): warned since 2026-11-29.
        monkeypatch.setenv("LOCKSTEP_OMP_FROM_LAUNCHER", "1")
        with pytest.warns(UserWarning, match=rf"computes on {want + 1} CPU threads"):
            VirtualShardDDP(nn.Linear(2, 2), 4)
        monkeypatch.delenv("LOCKSTEP_OMP_FROM_LAUNCHER")
        if want != 1:
            torch.set_num_threads(1)
            monkeypatch.setenv("OMP_NUM_THREADS", "1")
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            with pytest.warns(UserWarning, match="computes on 1 CPU threads"):
                VirtualShardDDP(nn.Linear(2, 2), 4)
            torch.set_num_threads(want + 1)
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            VirtualShardDDP(nn.Linear(2, 2), 4)
    finally:
        torch.set_num_threads(before)


def test_sampler_state_of_another_run_is_refused_by_name():
    """A state saved with shuffle=True into a shuffle=False sampler (a different order), one
    with more steps done than this dataset's epoch has (a len() below zero followed), and one
    without its step are refused, each naming what differs."""
    data = list(range(40))
    saved = VirtualShardSampler(data, 4, 2, num_replicas=1, rank=0, shuffle=True).state_dict(steps=3)
    assert saved["shuffle"] is True
    with pytest.raises(ValueError, match="shuffle=True, this one shuffle=False"):
        VirtualShardSampler(data, 4, 2, num_replicas=1, rank=0, shuffle=False).load_state_dict(saved)
    small = VirtualShardSampler(list(range(16)), 4, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="3 steps of epoch 0 were done.*has 2"):
        small.load_state_dict(saved)
    assert len(small) == 2  # unchanged by the refused state
    with pytest.raises(ValueError, match=r"lacks \['steps'\]"):
        small.load_state_dict({"epoch": 0})
    resumed = VirtualShardSampler(data, 4, 2, num_replicas=2, rank=1, shuffle=True)
    resumed.load_state_dict(saved)
    assert len(resumed) == 5 - 3
