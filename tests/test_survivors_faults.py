"""lockstep.Survivors under faults at awkward points of a step (an outside audit, 2026-11-29):
a peer lost after ``optimizer.step()`` (the step counts once, no second update), a peer lost
before a ``Checkpointer.save()`` inside the step (a peer's failure within a second, not a
ten-minute wait), and what ``track()`` refuses (ZeRO, fully_shard)."""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.checkpoint import meeting
from lockstep.checkpoint.io import CheckpointError
from lockstep.resilience.roster import Member, dead_key
from lockstep.resilience.survivors import Survivors, is_peer_failure

# A job that trains with Adam and an LR schedule stepped right after the optimizer (both
# tracked), all-reduces its loss after them (a metric), saves every 3 steps inside the step,
# and SIGKILLs one slot's first process at a point of a step (--fault SLOT:STEP:POINT). Each
# process logs "step epoch slot index..." once its update is applied, before the fault.
JOB = '''
import argparse, os, signal, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
import lockstep

SAMPLES, BATCH = 96, 4


class Indexed(Dataset):
    def __init__(self):
        self.data = dataset()

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i, self.data[i]


def dataset():
    return torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))


def build(group=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model = lockstep.DistributedDataParallel(net, process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.3 * s))
    return net, model, optimizer, scheduler


def update(model, optimizer, scheduler, x):
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()  # right after the optimizer: no collective between them


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fault", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt")
    p.add_argument("--ckpt-timeout", type=float, default=600.0)
    p.add_argument("--save-first", action="store_true", help="save at the top of the step")
    a = p.parse_args()
    fault = tuple(a.fault.split(":")) if a.fault else None
    team = lockstep.Survivors(admit_every=2)
    net, model, optimizer, scheduler = build()
    team.track(model, optimizer, scheduler=scheduler)
    replacement = "LOCKSTEP_SURVIVOR_JOIN" in os.environ or "LOCKSTEP_SURVIVOR_SPARE" in os.environ
    ckpt = (lockstep.Checkpointer(a.ckpt, timeout=a.ckpt_timeout, blocking=True)
            if a.ckpt else None)  # blocking: each save is on disk before the next step
    sampler = lockstep.DistributedSampler(Indexed(), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    log = open(f"{a.out}.logs/slot{team.slot}-{os.getpid()}.txt", "w", buffering=1)

    def fire(point):
        if fault == (str(team.slot), str(team.completed), point) and not replacement:
            os.kill(os.getpid(), signal.SIGKILL)

    for idx, x in team.batches(loader, epochs=100):
        if team.completed >= a.steps:
            break
        with team.step():
            if ckpt is not None and a.save_first and team.completed and team.completed % 3 == 0:
                fire("save")  # the documented recipe: save first, before the update
                ckpt.save(team.completed, model=model, optimizer=optimizer)
            update(model, optimizer, scheduler, x)
            print(team.completed, sampler.epoch, team.slot, *idx.tolist(), file=log)
            fire("after_opt")
            loss = torch.ones(1)
            dist.all_reduce(loss)
            if ckpt is not None and not a.save_first and (team.completed + 1) % 3 == 0:
                fire("save")
                ckpt.save(team.completed + 1, model=model, optimizer=optimizer)
            if team.world_size < team.slots:
                time.sleep(0.5)  # room for the replacement to be admitted before the end
    if team.rank == 0:
        torch.save({"params": [q.detach().clone() for q in net.parameters()],
                    "history": team.history, "completed": team.completed,
                    "adam_steps": int(optimizer.state[net[0].weight]["step"]),
                    "scheduled": scheduler.last_epoch}, a.out)
    team.finish()


if __name__ == "__main__":
    main()
'''


def _job(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("survivors_faults_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay(rank: int, script: str, phases: list, folder: str, used: dict) -> None:
    """The run again without failures: phase by phase (steps ``start..end-1`` in a world of
    ``slots``), the first ``len(slots)`` ranks train on the samples recorded for each step and
    slot, from the state the previous phase saved."""
    job = _job(Path(script))
    lockstep.init_distributed()
    data = job.dataset()
    state_in = None
    for start, end, slots in phases:
        group = dist.new_group(list(range(len(slots))))
        state_out = f"{folder}/phase{start}.pt"
        if rank < len(slots):
            net, model, optimizer, scheduler = job.build(group)
            if state_in:
                state = torch.load(state_in, weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
            for step in range(start, end):
                job.update(model, optimizer, scheduler, data[used[step, slots[rank]]])
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "params": [p.detach().clone() for p in net.parameters()]}, state_out)
        dist.barrier()
        state_in = state_out


def _run_job(tmp_path: Path, *args: str, timeout: float = 100) -> tuple[dict, dict, str]:
    script, out = tmp_path / "job.py", tmp_path / "out.pt"
    script.write_text(JOB)
    Path(f"{out}.logs").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--survivors", "--max-restarts", "1",
         "--nproc-per-node", "2", str(script), "--out", str(out), *args],
        check=False, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    used: dict = {}
    for path in Path(f"{out}.logs").iterdir():
        for line in path.read_text().splitlines():
            step, _, slot, *indices = (int(v) for v in line.split())
            assert (step, slot) not in used, f"step {step} of slot {slot} updated twice"
            used[step, slot] = indices
    return torch.load(out, weights_only=False), used, done.stderr


@pytest.mark.timeout(150)
def test_a_peer_lost_after_the_optimizer_step_counts_the_step_once(tmp_path) -> None:
    # Slot 1 dies after its update, before the loss's all-reduce: slot 0 had applied the same
    # update (its gradients were both ranks'). It ran the step again before 2026-11-29, a
    # second Adam update and a second step of the schedule on the same samples.
    result, used, _ = _run_job(tmp_path, "--steps", "10", "--fault", "1:4:after_opt")
    history = result["history"]
    assert [slots for _, slots in history] == [(0, 1), (0,), (0, 1)], history
    assert history[1][0] == 5  # step 4 done: the world of one begins with step 5
    assert result["completed"] == result["adam_steps"] == result["scheduled"] == 10
    ends = [start for start, _ in history[1:]] + [10]
    assert set(used) == {(step, slot) for (start, slots), end in zip(history, ends)
                         for step in range(start, end) for slot in slots}
    # The same worlds and samples without a failure: equal bit for bit.
    phases = [(start, end, list(slots)) for (start, slots), end in zip(history, ends)]
    lockstep.spawn(_replay, args=(str(tmp_path / "job.py"), phases, str(tmp_path), used),
                   nprocs=2, timeout=90, start_method="forkserver")
    replayed = torch.load(tmp_path / f"phase{phases[-1][0]}.pt", weights_only=True)["params"]
    for got, want in zip(result["params"], replayed, strict=True):
        assert torch.equal(got, want)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("first", [
    pytest.param(False, id="save-after-update", marks=pytest.mark.slow),
    pytest.param(True, id="save-first", marks=pytest.mark.slow),
])
def test_a_peer_killed_before_its_save_is_a_peer_failure_within_seconds(tmp_path, first) -> None:
    # Slot 1 dies before the save that makes step 6's checkpoint: after its update of step 5
    # (the save at the end of the step), or at the top of step 6 (the documented recipe: save
    # first). Slot 0 waited in the Checkpointer's meeting for the whole timeout before
    # 2026-11-29, then stopped the job with a CheckpointError that was no peer's failure (a
    # spare waited in vain): the old way fails here, after the 40 s timeout.
    fault = "1:6:save" if first else "1:5:save"
    result, _, stderr = _run_job(tmp_path, "--steps", "10", "--fault", fault, "--ckpt",
                                 str(tmp_path / "ck"), "--ckpt-timeout", "40",
                                 *(["--save-first"] if first else []))
    assert "SIGKILL" in stderr and "a warm spare" in stderr
    history = result["history"]
    # The spare may be waiting already when the roll call ends (the meeting noticed the death
    # within a second): it is admitted at once, or at a later admission.
    assert [slots for _, slots in history] in ([(0, 1), (0,), (0, 1)], [(0, 1), (0, 1)]), history
    # After the update: step 5's update stands and its save is skipped. Save first: step 6 had
    # not updated, so it runs again in the new world, save included.
    assert history[1][0] == 6
    assert result["completed"] == result["adam_steps"] == result["scheduled"] == 10
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step_"))
    assert saved[:1] == ["step_000000000003"], saved
    assert ("step_000000000006" in saved) == first, saved


# ---- a plain job (no --survivors): a dead peer ends the meeting at once ---------------------
PLAIN = '''
import os, signal, sys, time
import torch
import torch.distributed as dist
import lockstep
from lockstep.diagnose.progress import tracker

lockstep.init_distributed()
tracker().publish_now()  # the record (host, pid) a peer reads
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.3)
ckpt = lockstep.Checkpointer(sys.argv[1], timeout=float(sys.argv[2]))
start = time.monotonic()
try:
    ckpt.save(1, model=torch.nn.Linear(2, 2))
except Exception as exc:
    print(f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    os._exit(0)
print("saved", flush=True)
os._exit(0)
'''


def _free_port() -> int:
    for port in random.sample(range(45000, 46000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 45000-45999")


# The meeting's death check runs in the default tier through this plain job; both survivors
# save cases run in the slow tier (about 14 s each).
@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_plain_job_whose_peer_died_fails_the_meeting_at_once(tmp_path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "LOCKSTEP_PROGRESS_INTERVAL": "0.5"}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), "60"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=100)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[1].returncode == -9
    line = next((x for x in out.splitlines() if "after" in x), out + err[-2000:])
    # It waited for the whole timeout (60 s here), then blamed rank 1 for not calling save()
    assert line.startswith("PeerLostError after "), line
    assert float(line.split()[2].rstrip("s:")) < 20, line
    assert "for rank(s) [1], which will never call it: rank 1 died (pid" in line, line


def test_the_meeting_tells_dead_ranks_from_absent_ones() -> None:
    # Progress records: exited or failed ranks, a process gone from this host, or a silence
    # long enough on another are dead; a rank that beats, or lives on this host, is only absent.
    silence = meeting._Silence()
    here, elsewhere = socket.gethostname(), "other-host"
    assert silence.dead(1, None, 1.0) is None
    assert "exited" in silence.dead(1, {"state": "exited"}, 1.0)
    assert "error of its own (boom)" in silence.dead(1, {"state": "raised", "error": "boom"}, 1.0)
    assert silence.dead(1, {"host": here, "pid": os.getpid(), "beat": 1}, 1.0) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert "died (pid" in silence.dead(1, {"host": here, "pid": child.pid, "beat": 1}, 1.0)
    assert silence.dead(2, {"host": elsewhere, "pid": 5, "beat": 3}, 0.01) is None
    silence._beats[2] = (3, time.monotonic() - 11)  # the same beat for 11 s
    assert "no sign of life" in silence.dead(2, {"host": elsewhere, "pid": 5, "beat": 3}, 0.01)
    assert silence.dead(2, {"host": elsewhere, "pid": 5, "beat": 4}, 0.01) is None  # beat again
    # A registered probe (lockstep.Survivors': the launcher's marks) is consulted too, and the
    # error it leads to is a peer's failure for Survivors and a CheckpointError for the rest.
    remove = meeting.add_absence_probe(lambda ranks: {r: "died: marked" for r in ranks if r == 3})
    try:
        assert meeting._dead_among([2, 3], meeting._Silence()) == {3: "died: marked"}
    finally:
        remove()
    assert meeting._dead_among([2, 3], meeting._Silence()) == {}
    lost = meeting.PeerLostError("rank 3 died", {3: "died"})
    assert isinstance(lost, CheckpointError) and is_peer_failure(lost)


def test_survivors_name_the_members_a_launcher_marked_dead() -> None:
    store = dist.HashStore()
    team = types.SimpleNamespace(_store=store, slot=0,
                                 _members=(Member(0, 10), Member(2, 30), Member(3, 40)))
    store.set(dead_key(2, 30), "-9")
    store.set(dead_key(3, 41), "-9")  # another process of slot 3: not this world's member
    assert Survivors._dead_members(team, [1, 2]) == {  # type: ignore[arg-type]
        1: "(slot 2, pid 30) died: a launcher marked it dead (-9)"}


class _Sharded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_track_refuses_what_keeps_the_world_it_was_built_in() -> None:
    # They crashed after the first kill before 2026-11-29 ("invalid root rank", size mismatches).
    team = lockstep.Survivors()  # a world of one
    try:
        model = lockstep.DistributedDataParallel(torch.nn.Linear(2, 2))
        zero = lockstep.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        with pytest.raises(TypeError, match="ZeroRedundancyOptimizer keeps the process group"):
            team.track(model, zero)
        sharded = lockstep.fully_shard(_Sharded())
        with pytest.raises(TypeError, match="fully_shard model keeps the process group"):
            team.track(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        team.track(model, optimizer)  # what is supported
        team.track(model, optimizer)  # again: one hook, the first one removed
        assert len(optimizer._optimizer_step_post_hooks) == 1
    finally:
        team.finish()
