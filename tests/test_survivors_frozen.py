"""lockstep.Survivors with a worker frozen (SIGSTOP: as a process stuck in the kernel or in a C
call), not dead: its launcher counts it lost once its heartbeat stands still for
``LOCKSTEP_SURVIVORS_HEARTBEAT_TIMEOUT`` seconds, kills it, and the job goes on as after a
SIGKILL. Before 2026-11-29 nothing noticed: the peer waited in its collective and the launcher
with it, for the process group's timeout (10 minutes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_survivors import SCRIPT, _read_logs, _replay

import lockstep
from lockstep.resilience.heartbeat import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    Silence,
    beat_interval,
    describe_state,
    heartbeat_timeout,
)

# tests/scripts/survivors_train.py's model, data and update, in a loop that freezes one slot's
# first process with SIGSTOP at a step (--freeze SLOT:STEP), or inside lockstep.Survivors()
# before the first world forms (--freeze SLOT:init), and optionally the first warm spare while
# it waits for a rank (--freeze-spare FILE: the first spare creates FILE, then stops).
JOB = '''
import argparse, os, signal, sys, time
from pathlib import Path
from torch.utils.data import DataLoader
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import survivors_train as base
import lockstep
from lockstep.resilience import survivors


def freeze_in(cls, name, when):
    original = getattr(cls, name)

    def frozen(self, *args, **kwargs):
        if when(self, *args):
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, *args, **kwargs)

    setattr(cls, name, frozen)


def spare_frozen_and_gone(mark):
    """Wait until the first spare froze (it wrote its pid) and its launcher killed it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pid = mark.read_text() if mark.exists() else ""
        if pid:
            try:
                state = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return True  # gone
            if state.rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return True


p = argparse.ArgumentParser()
p.add_argument("script")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--freeze", required=True)
p.add_argument("--freeze-spare")
p.add_argument("--out", required=True)
p.add_argument("--log-dir", required=True)
a = p.parse_args()
slot, step = a.freeze.split(":")
first = "LOCKSTEP_SURVIVOR_JOIN" not in os.environ
mark = Path(a.freeze_spare or os.devnull)
if step == "init" and first and os.environ.get("RANK") == slot:
    # After the frozen spare is gone (if one freezes): it is not named for this rank.
    freeze_in(survivors.Survivors, "_init_group", lambda self, prefix, *_: prefix == "g0/pg/"
              and (not a.freeze_spare or spare_frozen_and_gone(mark)))
if a.freeze_spare and os.environ.get("LOCKSTEP_SURVIVOR_SPARE") == "1":
    freeze_in(survivors.Survivors, "_wait_for_a_rank",  # the first spare only
              lambda self: not mark.exists() and mark.write_text(str(os.getpid())) > 0)
team = lockstep.Survivors(admit_every=2)
net, model, optimizer = base.build()
team.track(model, optimizer)
sampler = lockstep.DistributedSampler(base.Indexed(), shuffle=True, seed=0)
loader = DataLoader(sampler.dataset, batch_size=base.BATCH, sampler=sampler)
log = (Path(a.log_dir) / f"slot{team.slot}-{os.getpid()}.txt").open("w", buffering=1)
for indices, x in team.batches(loader, epochs=1000):
    if team.completed >= a.steps:
        break
    with team.step():
        if first and (str(team.slot), str(team.completed)) == (slot, step):
            os.kill(os.getpid(), signal.SIGSTOP)  # in the step, connections open
        base.train_on(model, optimizer, x)
        print(team.completed, sampler.epoch, team.slot, *indices.tolist(), file=log)
        time.sleep(0.05 if team.world_size == team.slots else 0.5)
if team.rank == 0:
    import torch
    torch.save({"params": [q.detach().clone() for q in net.parameters()],
                "history": team.history}, a.out)
team.finish()
'''


def _run(tmp_path: Path, steps: int, *args: str) -> tuple[list, dict, str]:
    job, out, logs = tmp_path / "job.py", tmp_path / "out.pt", tmp_path / "logs"
    job.write_text(JOB)
    logs.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--survivors", "--max-restarts", "2",
         "--nproc-per-node", "2", str(job), str(SCRIPT), "--steps", str(steps), *args,
         "--out", str(out), "--log-dir", str(logs)],
        env={**os.environ, TIMEOUT_ENV: "2"}, check=False, capture_output=True, text=True,
        timeout=150)  # without the heartbeat: a hang, ended here
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = torch.load(out, weights_only=False)
    return result["history"], {"params": result["params"], "used": _read_logs(logs)}, done.stderr


def _equals_its_replay(tmp_path: Path, history: list, steps: int, found: dict) -> None:
    """The same worlds and samples without a failure give the same parameters, bit for bit."""
    ends = [start for start, _ in history[1:]] + [steps]
    used = {key: indices for key, (_, indices) in found["used"].items()}
    assert set(used) == {(step, slot) for (start, slots), end in zip(history, ends)
                         for step in range(start, end) for slot in slots}
    phases = [(start, end, list(slots)) for (start, slots), end in zip(history, ends)]
    lockstep.spawn(_replay, args=(phases, str(tmp_path), used), nprocs=2, timeout=120,
                   start_method="forkserver")
    replayed = torch.load(tmp_path / f"phase{phases[-1][0]}.pt", weights_only=True)["params"]
    for got, want in zip(found["params"], replayed, strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_rank_is_counted_lost_and_the_result_equals_the_same_schedule(tmp_path) -> None:
    history, found, stderr = _run(tmp_path, 12, "--freeze", "1:4")
    assert "rank 1 (pid" in stderr and "has sent no heartbeat for" in stderr, stderr[-3000:]
    assert "is stopped (SIGSTOP" in stderr and "a warm spare" in stderr, stderr[-3000:]
    assert "was killed by SIGKILL (by this launcher: frozen: no heartbeat for" in stderr
    assert [slots for _, slots in history] == [(0, 1), (0,), (0, 1)], history
    assert history[1][0] == 4  # frozen before its update: step 4 runs again in a world of one
    _equals_its_replay(tmp_path, history, 12, found)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_frozen_in_survivors_and_a_frozen_spare_are_counted_lost(tmp_path) -> None:
    # Rank 1 stops inside lockstep.Survivors(), before the first world forms: rank 0 forms a
    # world of one (it waited in the first group's creation for ten minutes before). The first
    # spare stops while it waits for a rank: killed, and another is started.
    history, found, stderr = _run(tmp_path, 10, "--freeze", "1:init",
                                  "--freeze-spare", str(tmp_path / "spare-frozen"))
    assert "a spare worker (pid" in stderr and "another is started" in stderr, stderr[-3000:]
    assert stderr.count("has sent no heartbeat for") == 2, stderr[-3000:]
    assert [slots for _, slots in history] == [(0,), (0, 1)], history
    assert history[0][0] == 0
    _equals_its_replay(tmp_path, history, 10, found)


def test_silence_counts_a_still_heartbeat_and_nothing_else() -> None:
    counts, now = {1: 0, 2: 0, 3: 0}, [0.0]
    silence = Silence(counts.__getitem__, timeout=5.0, clock=lambda: now[0])
    assert silence.silent([1, 2, 3]) == {}
    counts.update({1: 1, 2: 1})  # 3 never beats: importing, or the script's own code
    now[0] = 1.0
    assert silence.silent([1, 2, 3]) == {}
    now[0] = 5.5
    counts[2] = 7  # busy but alive: its thread beats
    assert silence.silent([1, 2, 3]) == {}
    now[0] = 6.5
    assert silence.silent([1, 2, 3]) == {1: 5.5}  # the same count since t=1
    counts.update({1: -(1 << 40), 2: 8})  # 1 stopped beating on purpose (its exit)
    now[0] = 20.0
    assert silence.silent([1, 2]) == {}
    now[0] = 30.0
    assert silence.silent([1, 2]) == {2: 10.0}  # 1 is no longer watched


def test_the_timeout_is_read_from_the_environment() -> None:
    assert heartbeat_timeout({}) == DEFAULT_TIMEOUT
    assert heartbeat_timeout({TIMEOUT_ENV: "2.5"}) == 2.5
    assert heartbeat_timeout({TIMEOUT_ENV: "off"}) is None
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}=.*positive seconds"):
            heartbeat_timeout({TIMEOUT_ENV: bad})
    assert beat_interval(60) == 1.0 and beat_interval(2) == 0.2


@pytest.mark.multirank
def test_a_stopped_process_is_described_as_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if describe_state(child.pid).startswith("stopped"):
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert describe_state(child.pid).startswith("stopped (SIGSTOP")
    finally:
        child.kill()
        child.wait()
    assert describe_state(child.pid) == ""
