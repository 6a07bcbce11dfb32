"""lockstep run --survivors on several machines: a lost machine's ranks leave the world, the
others go on, a launcher started again for the machine brings replacements; the result is the
run that was given the same schedule of worlds, bit for bit. Machines are launchers on
127.0.0.1, each in a session of its own (its process group is its machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_survivors import SCRIPT, _read_logs, _replay

import lockstep
from lockstep.launcher.machines import Machines
from lockstep.launcher.spawn import find_free_port
from lockstep.resilience.losses import LossWatch
from lockstep.resilience.roster import dead_key

STEPS = 40


class _Store:
    """The few store calls Machines makes, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_a_silent_machine_is_counted_lost_after_the_timeout_and_a_replacement_retires_it() -> None:
    store, now = _Store(), [0.0]
    first = Machines(store, 0, 3, timeout=2.0, clock=lambda: now[0])
    second = Machines(store, 1, 3, timeout=2.0, clock=lambda: now[0])
    assert not first.replacement and not second.replacement
    second.beat({2: 222, 3: 333})
    assert first.check() == {} and first.others_alive()  # machine 2 has not started: not late
    assert first.never_seen() == [2]  # named in the launcher's waiting lines
    now[0] = 1.9
    assert first.check() == {}  # silent, but not for long enough
    now[0] = 2.1
    assert first.check() == {1: {2: 222, 3: 333}}  # counted lost once, its ranks marked dead
    assert store.check([dead_key(2, 222), dead_key(3, 333)]) and store.get("loss/1") == b"1"
    assert first.check() == {} and not first.others_alive()
    again = Machines(store, 1, 3, timeout=2.0, clock=lambda: now[0])  # a replacement machine
    assert again.replacement and again.retire_predecessor() == {2: 222, 3: 333}
    again.beat({2: 444, 3: 555})
    now[0] = 3.0
    assert first.check() == {} and first.others_alive()  # beating again
    second.finished()
    now[0] = 9.0
    assert first.check() == {}  # finished: not lost when it stops beating
    with pytest.raises(ValueError, match="--node-timeout"):
        Machines(store, 0, 2, timeout=0)


def test_the_loss_watch_acts_on_announced_losses_that_touch_this_world() -> None:
    store, asked, acted = _Store(), [], []
    dead = {"now": False}

    def affected(_store) -> bool:
        asked.append(dead["now"])
        return dead["now"]

    store.add("losses", 1)  # a loss before the watch started: not this world's business
    store.set("loss/1", "1")
    watch = LossWatch(lambda: store, affected, lambda: acted.append(1), threading.Lock(),
                      poll=0.01)
    try:
        store.set("loss/2", "2")  # a machine whose ranks are not in this world
        _wait(lambda: len(asked) == 1, 5, "the watch to look at loss 2")
        dead["now"] = True
        store.set("loss/3", "1")  # one of this world's members
        _wait(lambda: len(acted) == 1, 5, "the watch to act on loss 3")
        assert asked == [False, True] and watch.acted == 1
    finally:
        watch.stop()
    store.set("loss/4", "1")
    time.sleep(0.1)
    assert len(asked) == 2  # stopped: no more looks


def _launcher(node: int, port: int, tmp_path: Path, extra: list[str]) -> subprocess.Popen:
    with (tmp_path / f"machine{node}-{time.monotonic_ns()}.txt").open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep", "run", "--survivors", "--nnodes", "2",
             "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--node-timeout", "2", "--max-restarts", "1", "--spares", "0",
             "--nproc-per-node", "1", str(SCRIPT), "--steps", str(STEPS), *extra],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _steps_logged(logs: Path, slot: int) -> int:
    """How many steps slot's processes have logged so far."""
    return sum(len(p.read_text().splitlines()) for p in logs.glob(f"slot{slot}-*.txt"))


def _wait(what, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {why}"
        time.sleep(0.05)


@pytest.mark.multirank
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["silent", pytest.param("killed", marks=pytest.mark.slow),
                                 pytest.param("healed", marks=pytest.mark.slow)])
def test_a_lost_machine_leaves_the_world_and_its_replacement_joins(tmp_path, how) -> None:
    """Machine 1 goes down at step 6: frozen with its sockets open (SIGSTOP: noticed only by
    the launchers' heartbeats; the default tier), or killed (SIGKILL: the slow tier); then its
    launcher is started again. Or (``healed``, slow) the frozen machine comes back on its own
    (SIGCONT, a partition that heals): its worker learns it was counted gone and stops, and its
    launcher gives the rank a replacement, which joins."""
    silent = how != "killed"
    out, logs = tmp_path / "out.pt", tmp_path / "logs"
    logs.mkdir()
    port = find_free_port()
    args = ["--lose-machine", "1:6", "--out", str(out), "--log-dir", str(logs)]
    args += ["--silent"] if silent else []
    first, second = (_launcher(node, port, tmp_path, args) for node in (0, 1))
    replacement = None
    try:
        _wait(lambda: second.poll() is not None or _stopped(second.pid), 120, "machine 1 to go down")
        if silent:  # nothing closed: only machine 0's launcher can tell, by the heartbeats
            log0 = next(tmp_path.glob("machine0-*.txt"))
            _wait(lambda: "machine 1 has not been heard from" in log0.read_text(), 30,
                  "machine 0's launcher to count machine 1 lost")
            # Rank 0 was blocked in step 6's all-reduce with the frozen rank: it goes on alone
            # while machine 1 still holds its connections open.
            _wait(lambda: _steps_logged(logs, 0) >= 9, 30, "rank 0 to go on without machine 1")
            assert _stopped(second.pid)
            if how == "healed":
                os.killpg(second.pid, signal.SIGCONT)  # back, with its old worker and sockets
            else:
                os.killpg(second.pid, signal.SIGKILL)  # the frozen machine is taken away
        if how != "healed":
            second.wait(timeout=30)
            replacement = _launcher(1, port, tmp_path, args)
        assert first.wait(timeout=150) == 0
        assert (replacement or second).wait(timeout=30) == 0
    finally:
        for proc in (first, second, replacement):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = "\n".join(p.read_text() for p in sorted(tmp_path.glob("machine*.txt")))
    if how == "healed":
        assert "was counted gone by its peers" in text and "a new process takes rank 1" in text, \
            text[-3000:]
    else:
        assert "this launcher replaces machine 1" in text, text[-3000:]
    result = torch.load(out, weights_only=False)
    history = result["history"]
    assert [slots for _, slots in history] == [(0, 1), (0,), (0, 1)], (history, text[-3000:])
    assert history[1][0] in (6, 7)  # the lost step runs again (or was finished by a peer)
    used = _read_logs(logs)
    ends = [start for start, _ in history[1:]] + [STEPS]
    assert len(used) == sum((end - start) * len(slots)
                            for (start, slots), end in zip(history, ends))
    phases = [(start, end, list(slots)) for (start, slots), end in zip(history, ends)]
    samples = {key: indices for key, (_, indices) in used.items()}
    lockstep.spawn(_replay, args=(phases, str(tmp_path), samples), nprocs=2, timeout=120,
                   start_method="forkserver")
    replayed = torch.load(str(tmp_path / f"phase{phases[-1][0]}.pt"), weights_only=True)["params"]
    for got, want in zip(result["params"], replayed, strict=True):
        assert torch.equal(got, want)
