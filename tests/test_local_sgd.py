"""Local SGD / DiLoCo: H=1 equals plain DDP; the outer Nesterov step matches a simulation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.comm import LocalSGD

STEPS = 6


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _sgd(params) -> torch.optim.Optimizer:
    # Momentum and weight decay are linear in the gradient, so averaging replicas after every
    # step is the same as averaging gradients: H=1 must equal DDP exactly.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _outer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model: torch.nn.Module, step_fn, opt: torch.optim.Optimizer, rank: int) -> torch.Tensor:
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        step_fn()
    return _flat(model)


def _simulate_diloco(world: int, sync_every: int) -> torch.Tensor:
    """DiLoCo by hand in one process: every rank's replica, then the outer Nesterov step."""
    replicas = [_net() for _ in range(world)]
    inner = [_sgd(r.parameters()) for r in replicas]
    anchors = [p.detach().clone() for p in replicas[0].parameters()]
    outer = _outer(anchors)
    for step in range(STEPS):
        for rank, (replica, opt) in enumerate(zip(replicas, inner)):
            opt.zero_grad()
            replica(_batch(rank, step)).square().mean().backward()
            opt.step()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for i, anchor in enumerate(anchors):
                    changes = [anchor - list(r.parameters())[i] for r in replicas]
                    anchor.grad = torch.stack(changes).mean(0)
                outer.step()
                for replica in replicas:
                    for p, anchor in zip(replica.parameters(), anchors):
                        p.copy_(anchor)
    return _flat(replicas[0])


def _worker(rank: int) -> dict:
    lockstep.init_distributed()
    world = dist.get_world_size()
    ddp = lockstep.DistributedDataParallel(_net())
    opt = _sgd(ddp.parameters())
    reference = _train(ddp, opt.step, opt, rank)

    plain = _net()
    opt = _sgd(plain.parameters())
    local = LocalSGD(plain, opt, sync_every=1)
    out = {"h1_plain": (_train(plain, local.step, opt, rank) - reference).abs().max().item()}

    wrapped = lockstep.DistributedDataParallel(_net())
    opt = _sgd(wrapped.parameters())
    local = LocalSGD(wrapped, opt, sync_every=1)
    out["h1_ddp"] = (_train(wrapped, local.step, opt, rank) - reference).abs().max().item()

    diloco_model = _net()
    opt = _sgd(diloco_model.parameters())
    local = LocalSGD(diloco_model, opt, sync_every=3, outer_optimizer=_outer)
    diloco = _train(diloco_model, local.step, opt, rank)
    out["diloco"] = (diloco - _simulate_diloco(world, 3)).abs().max().item()
    out["bytes_per_step"] = local.counter.bytes_per_step()
    out["param_bytes"] = 4 * diloco.numel()

    # A layer frozen when LocalSGD is built and unfrozen at step 3 (fine-tuning) is merged
    # from then on: every rank holds the same model after the last merge (it never was).
    thawed = _net()
    thawed[0].requires_grad_(False)
    opt = _sgd(thawed.parameters())
    local_thawed = LocalSGD(thawed, opt, sync_every=2)
    for step in range(STEPS):
        if step == 3:
            thawed[0].requires_grad_(True)
        opt.zero_grad()
        thawed(_batch(rank, step)).square().mean().backward()
        local_thawed.step()
    everyone = [torch.empty_like(_flat(thawed)) for _ in range(world)]
    dist.all_gather(everyone, _flat(thawed))
    out["thawed_equal"] = all(torch.equal(t, everyone[0]) for t in everyone)
    out["thawed_moved"] = not torch.equal(thawed[0].weight, _net()[0].weight)
    # DiLoCo's outer optimizer covers the parameters trainable when it was built: refused.
    frozen = _net()
    frozen[0].requires_grad_(False)
    opt = _sgd(frozen.parameters())
    outer_local = LocalSGD(frozen, opt, sync_every=2, outer_optimizer=_outer)
    frozen[0].requires_grad_(True)
    try:
        outer_local.step()
        out["diloco_thawed"] = "accepted"
    except ValueError as exc:
        out["diloco_thawed"] = str(exc)

    restored = LocalSGD(_net(), _sgd(_net().parameters()), 3, outer_optimizer=_outer)
    restored.load_state_dict(local.state_dict())
    out["restored"] = all(
        torch.equal(a, b) for a, b in zip(restored._anchors, local._anchors)
    ) and restored.local_steps == STEPS
    return out


@pytest.mark.multirank
def test_local_sgd_at_world_2():
    for out in lockstep.spawn(_worker, 2, timeout=120):
        assert out["h1_plain"] < 1e-6, out
        assert out["h1_ddp"] < 1e-6, out
        assert out["diloco"] < 1e-6, out
        # One merge of the parameters every 3 steps.
        assert out["bytes_per_step"] == out["param_bytes"] / 3
        assert out["restored"]
        assert out["thawed_equal"] and out["thawed_moved"]
        assert "parameter '0.weight' became trainable after LocalSGD was built" in out["diloco_thawed"]


@pytest.fixture
def optimizer_env(monkeypatch, tmp_path):
    """Building a torch optimizer sets TORCHINDUCTOR_CACHE_DIR on first use; pin it here so the
    leak check does not blame this test for torch's own setting."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))


def test_sync_every_must_be_positive(optimizer_env):
    model = _net()
    with pytest.raises(ValueError, match="sync_every must be at least 1"):
        LocalSGD(model, _sgd(model.parameters()), sync_every=0)
    for bad in (2.5, float("nan"), True, "2"):  # 2.5 merged at step 5 only, nan never merged
        with pytest.raises(TypeError, match="sync_every must be an int"):
            LocalSGD(model, _sgd(model.parameters()), sync_every=bad)


def test_load_state_dict_names_outer_optimizer_mismatch(optimizer_env):
    model = _net()
    local = LocalSGD.__new__(LocalSGD)  # no process group needed to check the state's shape
    local.optimizer, local.outer, local._anchors = _sgd(model.parameters()), None, []
    saved = {
        "local_steps": 1, "optimizer": local.optimizer.state_dict(), "outer": {}, "anchors": [],
    }
    with pytest.raises(ValueError, match="disagree on outer_optimizer"):
        local.load_state_dict(saved)


def _resume_worker(rank: int, directory: str, outer: bool) -> float:
    """Train 10 steps (H=4) with a save at step 6, between two merges; then build everything
    afresh, restore step 6 and train on: the parameters must be those of the run that went on."""
    lockstep.init_distributed()

    def build():
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # per-rank moments
        return model, opt, LocalSGD(model, opt, sync_every=4, outer_optimizer=_outer if outer else None)

    def train(model, opt, local, steps, save=None):
        for step in steps:
            opt.zero_grad()
            model(_batch(rank, step)).square().mean().backward()
            local.step()
            if save is not None and step + 1 == 6:
                save(step + 1)
        return _flat(model)

    ckpt = lockstep.Checkpointer(directory)
    model, opt, local = build()
    whole = train(model, opt, local, range(10), save=lambda s: ckpt.save(s, model=model, local=local))
    ckpt.wait()
    model, opt, local = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing of the fresh model may survive the restore
    assert ckpt.restore(model=model, local=local).step == 6
    resumed = train(model, opt, local, range(6, 10))
    return (resumed - whole).abs().max().item()


@pytest.mark.parametrize("outer", [False, True], ids=["local-sgd", "diloco"])
def test_checkpoint_resumes_every_replica_between_merges(tmp_path, outer):
    """Between merges each rank has its own replica and inner optimizer state: the
    Checkpointer saves LocalSGD one piece per rank, so a resume is exact on every rank."""
    diffs = lockstep.spawn(_resume_worker, 2, args=(str(tmp_path / "ckpt"), outer), timeout=120)
    assert diffs == [0.0, 0.0]


def _refusals_worker(rank: int) -> list[str]:
    lockstep.init_distributed()
    torch.manual_seed(rank)  # every rank builds a different model
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
    model[0].bias.requires_grad_(False)
    LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    state = torch.cat([t.detach().float().flatten() for t in [*model.parameters(), *model.buffers()]])
    everyone = [torch.empty_like(state) for _ in range(2)]
    dist.all_gather(everyone, state)
    out = ["equal" if torch.equal(*everyone) else "differ"]
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    sharded = lockstep.fully_shard(_net())
    zero = lockstep.ZeroRedundancyOptimizer(_net().parameters(), torch.optim.SGD, lr=0.1)
    torch_zero = TorchZero(_net().parameters(), torch.optim.SGD, lr=0.1)
    for model, opt in ((sharded, _sgd(sharded.parameters())), (_net(), zero), (_net(), torch_zero)):
        try:
            LocalSGD(model, opt, sync_every=2)
            out.append("accepted")
        except TypeError as exc:
            out.append(str(exc))
    return out


@pytest.mark.multirank
def test_frozen_and_integer_state_start_equal_and_sharded_state_is_refused():
    """A plain module's frozen parameters and integer buffers start equal too (only the
    trainable ones were broadcast); a fully_shard model, lockstep's and torch's ZeRO are refused
    (each was accepted and trained as something else)."""
    for equal, sharded, zero, torch_zero in lockstep.spawn(_refusals_worker, 2, timeout=120):
        assert equal == "equal"
        assert "sharded by fully_shard" in sharded
        assert "ZeroRedundancyOptimizer shards the optimizer" in zero
        assert "ZeroRedundancyOptimizer shards the optimizer" in torch_zero
