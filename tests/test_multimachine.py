"""Several machines, stood in for by several `lockstep run` launchers on this host (the
`multimachine` tier: `pytest -m multimachine`).

Each launcher is one "machine" with its own workers; they meet through the rendezvous at an
endpoint as machines would. Checked: c10d and static rendezvous give the same weights as one
machine with the same world (a late joiner first makes the others say what they wait for); a
machine SIGKILLed from an elastic job is named, and the survivor resumes from the last
checkpoint at the new world with the exact sample stream; a mismatched job id and an endpoint
nobody answers are named within seconds. Every launcher's output is checked for C++ stack
traces and rendezvous-shutdown warnings. The pure formatting is tested without processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lockstep.launcher.rendezvous_report import Meeting, Member, RoundView, Visitor, rank_ranges

SCRIPT = Path(__file__).parent / "scripts" / "launcher" / "machines.py"
RUN_TIMEOUT_S = 150  # a launch that takes longer is a hang, not slowness
# Lines a clean multi-machine job must not print on any machine.
NOISE = ("frame #", "failed to shutdown the rendezvous", "GLHF", "recvVector", "recvValue",
         "Error waiting on exit barrier")


# ---------------------------------------------------------------------- pure formatting


def _meeting(lines: list[str], min_nodes: int = 2) -> Meeting:
    return Meeting("10.0.0.1:29400", "train7", min_nodes=min_nodes, max_nodes=2, join_timeout=600,
                   hosting=True, max_restarts=2, say=lines.append, interval=5)


def test_waiting_line_and_timeout_name_what_was_seen():
    lines: list[str] = []
    meeting = _meeting(lines)
    view = RoundView(0, False, (), (Member("a_1_0", "host-a", -1, 2),))
    me = "a_1_0"
    visitors = [Visitor(me, "host-a", 1, "train7", "2"), Visitor("b_2_0", "host-b", 2, "train8", "2"),
                Visitor("c_3_0", "host-c", 3, "train7", "3")]
    line = meeting.waiting_line(view, visitors, me, 30.4)
    assert line.startswith("waiting for machines at 10.0.0.1:29400 (job train7, hosted here): "
                           "1 of 2 joined (host-a) after 30 s; giving up at 600 s")
    assert "a launcher on host-b (pid 2) reached this endpoint with --rdzv-id train8" in line
    assert "a launcher on host-c (pid 3) asked for --nnodes 3 (this one: 2)" in line
    elastic = _meeting([], min_nodes=1).waiting_line(view, [], me, 3)
    assert "1 joined (1 needed, up to 2) (host-a) after 3 s" in elastic
    # Enough machines: the round starts at its last call, not at the join timeout.
    assert elastic.endswith("starting with 1 machine 30 s after the last one joined, unless "
                            "more join (last_call_timeout)"), elastic
    error = meeting.timeout_message(view, visitors[:1], me)
    assert "no rendezvous at 10.0.0.1:29400 (job train7) within 600 s: 1 machine joined " \
           "(host-a) of the 2 needed; no other launcher reached the endpoint." in error
    assert "the same --rdzv-id (train7) and the same --nnodes (2)" in error


def test_a_store_hosted_by_another_job_is_said_once():
    """Two jobs on one endpoint: the one that hosts the store closes it when it ends, and the
    other stops with it. The other job's launchers say so when they meet, once."""
    import json
    from types import SimpleNamespace

    from lockstep.launcher import rendezvous

    class Store(dict):
        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key]

    store = Store({rendezvous._HOST_KEY: json.dumps(
        {"run_id": "jobX", "host": "host-a", "pid": 42}).encode()})
    job = {"run_id": "jobY"}

    class Handler(rendezvous.FreshStoreRendezvousHandler):
        def __init__(self):  # only what the warning reads
            pass

        @property
        def settings(self):
            return SimpleNamespace(**job)

        def _rdzv_store(self):
            return store

    handler = Handler()
    lines: list[str] = []
    meeting = _meeting(lines)
    handler._warn_of_foreign_host(meeting)
    handler._warn_of_foreign_host(meeting)
    assert len(lines) == 1 and ("hosted by the launcher of another job (--rdzv-id jobX, on "
                                "host-a, pid 42)") in lines[0], lines
    job["run_id"] = "jobX"  # its own job's host: nothing to say
    handler._warned_foreign_host = False
    lines.clear()
    handler._warn_of_foreign_host(meeting)
    assert lines == []


def test_membership_changes_are_named():
    lines: list[str] = []
    meeting = _meeting(lines, min_nodes=1)
    a, b = Member("a_1_0", "host-a", 0, 2), Member("b_2_0", "host-b", 1, 2)
    assert rank_ranges((a, b)) == {"a_1_0": (0, 1), "b_2_0": (2, 3)}
    meeting.announce(RoundView(1, True, (a, b)))
    assert lines == [("2 machines met at 10.0.0.1:29400 (job train7): machine 0 (host-a, ranks 0-1), "
                     "machine 1 (host-b, ranks 2-3); world 4")]
    lines.clear()
    evidence = {2: {"rank": 2, "host": "host-b", "step": 140, "state": "gone"}}
    meeting.announce(RoundView(2, True, (a,)), evidence, failed=True)
    assert lines == [
        ("machine 1 (host-b, ranks 2-3) left at step ~140: its launcher stopped answering; "
        "its workers fell silent mid-collective"),
        "restart 1 of 2 with 1 machine, world 2 (was 4): machine 0 (host-a, ranks 0-1)",
    ]
    lines.clear()
    c = Member("c_3_0", "host-c", 1, 1)
    meeting.announce(RoundView(3, True, (a, c), heartbeat_age={"c_3_0": 0.5}), failed=False)
    assert lines == ["machine 1 (host-c, rank 2) joined",
                     ("new round (membership changed) with 2 machines, world 3 (was 2): "
                     "machine 0 (host-a, ranks 0-1), machine 1 (host-c, rank 2)")]


# ------------------------------------------------------------------------- real launchers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_address() -> str:
    """An address of this machine other than loopback (for the c10d backend), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.123", 9))  # no packet is sent; picks the outgoing address
            address = probe.getsockname()[0]
        with socket.socket() as check:
            check.bind((address, 0))
        return address
    except OSError:
        return "127.0.0.1"


def _hosting(proc: subprocess.Popen, endpoint: str, log: Path) -> None:
    """Wait until ``proc`` listens at ``endpoint``: it hosts the rendezvous store, and the
    launchers started next connect to it."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listened at {endpoint}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(OMP_NUM_THREADS="1", LOCKSTEP_RDZV_REPORT_INTERVAL="1", **extra)
    return env


def _start(log: Path, *argv: str, new_session: bool = False) -> subprocess.Popen:
    command = [sys.executable, "-m", "lockstep", "run", *argv]
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=new_session)


def _finish(*procs: subprocess.Popen) -> list[int]:
    codes = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(-999)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
            proc.wait()
    return codes


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _clean(log: Path) -> str:
    """The log, checked for noise (torch's C++ traces, a rendezvous that failed to shut down)."""
    text = log.read_text()
    for noise in NOISE:
        assert noise not in text, f"{log.name} printed {noise!r}:\n{text[-3000:]}"
    return text


def _weights(folder: Path, restart: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"final_{restart}.pt", weights_only=True)


def _train(folder: Path, steps: int = 6) -> list[str]:
    folder.mkdir()
    return [str(SCRIPT), str(folder), str(steps)]


@pytest.mark.slow
@pytest.mark.multimachine
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_two_launchers_c10d_and_static_equal_one_machine(tmp_path):
    """One machine with 2 workers = 2 launchers with 1 each, met by static rendezvous, or by
    c10d with the second machine late (the first says what it waits for) and its worker
    SIGKILLed once mid-run: both restart at the same world from the newest checkpoint, and
    the weights are bitwise those of the uninterrupted run."""
    host = _local_address()
    c10d = f"{host}:{_free_port()}"
    static_port = str(_free_port())
    logs = {name: tmp_path / f"{name}.log" for name in ("one", "c0", "c1", "s0", "s1")}
    ckpt = ["--ckpt", str(tmp_path / "ckpt-one"), "--every", "2"]
    procs = [_start(logs["one"], "--nproc-per-node", "2", *_train(tmp_path / "one"), *ckpt)]
    common = ["--nnodes", "2", "--nproc-per-node", "1"]
    spair = _train(tmp_path / "static")
    for rank in (0, 1):
        procs.append(_start(logs[f"s{rank}"], *common, "--rdzv-backend", "static",
                            "--master-addr", "127.0.0.1", "--master-port", static_port,
                            "--node-rank", str(rank), *spair))
    pair = [*common, "--max-restarts", "1", "--rdzv-endpoint", c10d, "--rdzv-id", "pair",
            *_train(tmp_path / "c10d"), "--ckpt", str(tmp_path / "ckpt-pair"), "--every", "2",
            "--kill-rank", "1", "--kill-at", "3"]
    procs.append(_start(logs["c0"], *pair))
    _hosting(procs[-1], c10d, logs["c0"])
    time.sleep(2)  # the late machine
    procs.append(_start(logs["c1"], *pair))
    codes = _finish(*procs)
    outputs = {name: log.read_text() for name, log in logs.items()}
    assert codes == [0] * 5, outputs
    texts = {name: _clean(log) for name, log in logs.items()}
    assert (tmp_path / "c10d" / "killed").exists(), "rank 1 was never killed: nothing was proved"
    reference = _weights(tmp_path / "one")
    for folder in ("c10d", "static"):
        # Rank 0's restart count: 1 if its own worker failed, 0 if its launcher only saw the
        # other machine come back (a membership change, which torch does not count).
        restart = max(int(p.stem.split("_")[1]) for p in (tmp_path / folder).glob("final_*.pt"))
        got = _weights(tmp_path / folder, restart)
        for key in reference:
            assert torch.equal(reference[key], got[key]), f"{folder}: {key} differs"
        world = json.loads((tmp_path / folder / f"world_{restart}.json").read_text())
        assert world["world"] == 2
        assert world["start"] == (2 if folder == "c10d" else 0), world  # the newest checkpoint
    assert f"waiting for machines at {c10d} (job pair" in texts["c0"]
    assert "1 of 2 joined" in texts["c0"]
    for name in ("c0", "c1"):
        assert f"2 machines met at {c10d} (job pair): machine 0 (" in texts[name]
    # The launcher whose worker was killed restarts; the other may see its own worker fail
    # too, or see the machine come back first and start a new round with it.
    both = texts["c0"] + texts["c1"]
    assert "restart 1 of 1 with 2 machines, world 2: machine 0 (" in both


@pytest.mark.slow
@pytest.mark.multimachine
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_lost_machine_is_named_and_the_survivor_resumes_at_the_new_world(tmp_path):
    """--nnodes 1:2, machine 1's launcher and worker SIGKILLed mid-training: machine 0 names
    the loss, restarts at world 1 from the newest checkpoint, with the exact sample stream."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    endpoint = f"127.0.0.1:{_free_port()}"
    steps, every, mark = 16, 2, 5
    argv = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
            "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2",
            str(SCRIPT), str(out), str(steps), "--delay", "0.15", "--ckpt", str(ckpt),
            "--every", str(every), "--mark", str(mark)]
    survivor = _start(tmp_path / "m0.log", *argv)
    # machine 0 hosts the rendezvous store: the one machine a job cannot lose
    _hosting(survivor, endpoint, tmp_path / "m0.log")
    doomed = _start(tmp_path / "m1.log", *argv, new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (out / "reached").exists() and time.monotonic() < deadline:
        assert survivor.poll() is None, (tmp_path / "m0.log").read_text()
        time.sleep(0.1)
    os.killpg(doomed.pid, signal.SIGKILL)  # the launcher and its worker, as a lost machine
    codes = _finish(survivor, doomed)
    log = (tmp_path / "m0.log").read_text()
    assert codes[0] == 0, log
    assert "machine 1 (" in log and ", rank 1) left at step ~" in log, log
    assert "restart 1 of 2 with 1 machine, world 1 (was 2)" in log, log
    # The survivor's worker said which rank was gone, not gloo's words.
    assert "rank 1 on " in log and " is gone" in log, log
    assert "GLHF" not in log
    finished = json.loads((out / "world_1.json").read_text())
    assert finished["world"] == 1
    start = finished["start"]
    assert start >= mark - every and start % every == 0, finished
    # The exact stream: world 2 consumed 2 x 2 samples per step up to the checkpoint; world 1
    # goes on from there through the same global order, then the next epoch.
    import lockstep

    dataset = list(range(48))
    order = []
    for epoch in (0, 1):
        sampler = lockstep.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        order += list(sampler)
    consumed = start * 4
    expected = order[consumed : consumed + (steps - start) * 2]
    assert finished["seen"] == [expected], finished


@pytest.mark.slow
@pytest.mark.multimachine
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_wrong_endpoint_and_wrong_job_id_are_named_within_seconds(tmp_path):
    """Two launchers at one endpoint with different --rdzv-id, and one at an address nobody
    answers: each says what it waits for, and a short join timeout ends each with what was
    seen and what to check."""
    port = _free_port()
    short = ["--nnodes", "2", "--rdzv-conf", "join_timeout=8"]
    job = _train(tmp_path / "job")
    a = _start(tmp_path / "a.log", *short, "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "jobA", *job)
    _hosting(a, f"127.0.0.1:{port}", tmp_path / "a.log")
    # a hosts the store; b gives up first (a host that leaves ends its clients)
    b = _start(tmp_path / "b.log", "--nnodes", "2", "--rdzv-conf", "join_timeout=2",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "jobB", *job)
    nowhere = f"203.0.113.1:{port}"  # TEST-NET-3: reserved, never answers
    c = _start(tmp_path / "c.log", *short, "--rdzv-endpoint", nowhere, "--rdzv-id", "jobA", *job)
    codes = _finish(a, b, c)
    texts = [_clean(tmp_path / f"{n}.log") for n in "abc"]
    assert codes == [1, 1, 1], texts
    a_text, b_text, c_text = texts
    assert f"waiting for machines at 127.0.0.1:{port} (job jobA, hosted here): 1 of 2 joined" in a_text
    assert "reached this endpoint with --rdzv-id jobB (this one: jobA)" in a_text
    assert f"no rendezvous at 127.0.0.1:{port} (job jobA) within 8 s: 1 machine joined" in a_text
    assert "Mismatched: a launcher on " in a_text
    assert "the same --rdzv-id (jobA)" in a_text
    assert f"waiting for machines at 127.0.0.1:{port} (job jobB, store reached)" in b_text
    assert "reached this endpoint with --rdzv-id jobA (this one: jobB)" in b_text
    assert f"no rendezvous at 127.0.0.1:{port} (job jobB) within 2 s" in b_text
    assert f"waiting for the rendezvous at {nowhere} (job jobA): cannot reach it yet" in c_text
    assert f"cannot reach the rendezvous at {nowhere}" in c_text


@pytest.mark.slow
@pytest.mark.multimachine
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_machine_joining_an_elastic_job_is_announced(tmp_path):
    """--nnodes 1:2: machine 0 starts alone; machine 1 joins mid-run. Both say who joined and
    the new world, and the job finishes at world 2 from the newest checkpoint."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    endpoint = f"127.0.0.1:{_free_port()}"
    argv = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "grow", "--rdzv-conf", "last_call_timeout=1",
            str(SCRIPT), str(out), "40", "--delay", "0.25", "--ckpt", str(ckpt), "--mark", "3"]
    # After the mark, machine 0 trains on for about 9 s: time for the second launcher to start
    # and join on a loaded machine (with 16 steps of 0.15 s it sometimes finished first).
    first = _start(tmp_path / "m0.log", *argv)
    _hosting(first, endpoint, tmp_path / "m0.log")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (out / "reached").exists() and time.monotonic() < deadline:
        assert first.poll() is None, (tmp_path / "m0.log").read_text()
        time.sleep(0.1)
    second = _start(tmp_path / "m1.log", *argv)
    codes = _finish(first, second)
    texts = [_clean(tmp_path / f"m{i}.log") for i in (0, 1)]
    assert codes == [0, 0], texts
    assert f"1 machine met at {endpoint} (job grow): machine 0 (" in texts[0]
    assert ", rank 1) joined" in texts[0]
    assert "new round (membership changed) with 2 machines, world 2 (was 1)" in texts[0]
    # A join is not a restart: torch does not count it, and the workers see restart count 0.
    finished = json.loads((out / "world_0.json").read_text())
    assert finished["world"] == 2 and finished["start"] > 0, finished


def test_a_port_held_by_another_program_is_named_at_the_deadline():
    """The endpoint accepts connections but never speaks the store's protocol (a web server, a
    stale process): torch's client waited for its handshake forever; now an error at the
    deadline says what holds the port."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from lockstep.launcher.stores import endpoint_store

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError,
                           match=f"accepts connections, but no rendezvous store answered.*"
                                 f"another program holds port {port}"):
            endpoint_store("127.0.0.1", port, timedelta(seconds=60), is_host=False,
                           deadline=time.monotonic() + 2)
        assert time.monotonic() - start < 10


def test_a_loopback_client_with_no_host_yet_says_it_cannot_reach_it():
    """``--rdzv-conf is_host=0`` on one machine before anyone hosts: nothing listens, so the
    message is "cannot reach" (is the host started?), not "another program holds the port"."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from lockstep.launcher.stores import open_loopback_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free again once closed: nothing listens there
    with pytest.raises(RendezvousConnectionError, match=f"cannot reach the rendezvous at "
                                                       f"127.0.0.1:{port}"):
        open_loopback_store(port, timedelta(seconds=60), host=False,
                            deadline=time.monotonic() + 2)


def test_a_member_whose_launcher_stopped_answering_is_lost_until_the_rendezvous_closes():
    """A machine that died while this one's workers wait for its workers (init_process_group)
    makes num_nodes_waiting() restart them without it; one that ended closed the rendezvous."""
    from datetime import datetime, timezone

    from lockstep.launcher.rendezvous import lost_members

    now = datetime.now(timezone.utc)
    beats = {"a": now - timedelta(seconds=1), "b": now - timedelta(seconds=20), "me": now}
    assert lost_members(["a", "b", "me"], beats, now, 15.0, "'me'", closed=False) == ["'b'"]
    assert lost_members(["a", "b", "me"], beats, now, 15.0, "'me'", closed=True) == []
    assert lost_members(["a", "me"], beats, now, 15.0, "'me'", closed=False) == []
