"""lockstep.Survivors: a killed rank leaves the world, the others go on, a replacement joins;
the result is the run that was given the same schedule of worlds, bit for bit."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.resilience.roster import Member, Proposal, dead_key, propose
from lockstep.resilience.sockets import GroupSockets
from lockstep.resilience.survivors import Survivors, is_peer_failure

SCRIPT = Path(__file__).parent / "scripts" / "survivors_train.py"


def _job():
    spec = importlib.util.spec_from_file_location("survivors_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay(rank: int, phases: list[tuple[int, int, list[int]]], folder: str, used: dict) -> None:
    """The survivors' run again without failures, in one world of three: phase by phase (steps
    ``start..end-1`` in a world of ``slots``), the first ``len(slots)`` ranks train in a group of
    their own (rank r plays slot ``slots[r]``) on the samples the survivors' run recorded for
    that step and slot; each phase starts from the state the previous one saved."""
    job = _job()
    lockstep.init_distributed()
    data = job.dataset()
    state_in = None
    for start, end, slots in phases:
        group = dist.new_group(list(range(len(slots))))  # every rank creates every group
        state_out = f"{folder}/phase{start}.pt"
        if rank < len(slots):
            net, model, optimizer = job.build(group)
            if state_in:
                state = torch.load(state_in, weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
            for step in range(start, end):
                job.train_on(model, optimizer, data[used[step, slots[rank]]])
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "params": [p.detach().clone() for p in net.parameters()]}, state_out)
        dist.barrier()
        state_in = state_out


def _read_logs(folder: Path) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """(step, slot) -> (epoch, sample indices), from every process's log."""
    used: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in folder.iterdir():
        for line in path.read_text().splitlines():
            step, epoch, slot, *indices = (int(v) for v in line.split())
            assert (step, slot) not in used, f"step {step} of slot {slot} completed twice"
            used[step, slot] = (epoch, indices)
    return used


def test_proposal_takes_the_furthest_member_and_round_trips() -> None:
    alive = [Member(2, 22, 7), Member(0, 10, 8), Member(3, 33, 8)]
    proposal = propose(5, alive, [Member(1, 11)])
    assert proposal.slots == [0, 1, 2, 3]
    assert proposal.source == 0 and proposal.step == 8  # most steps; the first slot among equals
    assert [m.step for m in proposal.members] == [8, -1, 7, 8]  # the replacement has none
    assert proposal.rank_of(2) == 2
    assert Proposal.decode(proposal.encode()) == proposal
    with pytest.raises(ValueError, match="surviving member"):
        propose(1, [], [Member(0, 1)])
    with pytest.raises(ValueError, match="claim one slot"):
        propose(1, [Member(0, 1, 3)], [Member(0, 2)])


def test_without_survivors_mode_a_step_error_propagates() -> None:
    team = lockstep.Survivors()  # plain python: a world of one, failures are not caught
    try:
        assert (team.rank, team.world_size, team.members) == (0, 1, [0])
        with pytest.raises(ZeroDivisionError), team.step():
            _ = 1 / 0
        assert team.completed == 0
        with team.step():
            pass
        assert team.completed == 1
    finally:
        team.finish()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spares, paced", [
    (1, False), pytest.param(0, False, marks=pytest.mark.slow),
    pytest.param(1, True, marks=pytest.mark.slow)])
def test_a_killed_rank_is_replaced_and_the_result_equals_the_same_schedule(
        tmp_path, spares, paced) -> None:
    """Two kills with a warm spare (the default): the first spare was started with the ranks,
    the second forked from the launcher's zygote; in the slow tier one kill and a new process
    importing torch, and two kills with saves paced by ``max_overhead`` (a replacement's
    Checkpointer has agreed on no pace: every rank meets at the first call of a new world)."""
    out, logs = tmp_path / "out.pt", tmp_path / "logs"
    logs.mkdir()
    steps = 30 if spares else 24
    # The second kill is of slot 0: its replacement, rank 0 at the end, writes the history it
    # received (it began at its own admission before 2026-11-28).
    kills = ["--kill", "1:6", "--kill", "0:16"] if spares else ["--kill", "1:6"]
    # A Checkpointer saves every 3 steps inside the step (asynchronously; blocking in the slow
    # variant): a kill can come while a save is written; the newest is restored at the end.
    saves = ["--ckpt", str(tmp_path / "ckpt"), "--save-every", "3"] + ([] if spares else
                                                                      ["--blocking"])
    if paced:
        saves = ["--ckpt", str(tmp_path / "ckpt"), "--save-every", "1", "--max-overhead", "0.05"]
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--survivors", "--max-restarts", "2",
         "--spares", str(spares), "--nproc-per-node", "3", str(SCRIPT), "--steps", str(steps),
         *kills, *saves, "--out", str(out), "--log-dir", str(logs)],
        check=False, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr
    assert "another is started" not in done.stderr  # no spare was killed
    assert done.stderr.count("a warm spare" if spares else "a new process") == len(kills) // 2
    # An admission loads the source's state only where it is not already there: it used to
    # write the survivors' parameters in place, which failed the save being copied meanwhile.
    assert "changed in place" not in done.stderr, done.stderr[-3000:]
    result = torch.load(out, weights_only=False)
    history = result["history"]
    # torchrun's variables: the final rank 0 is the second replacement with spares (the kill
    # of slot 0 came second), the first worker without.
    assert result["env"] == {"TORCHELASTIC_MAX_RESTARTS": "2",
                             "TORCHELASTIC_RESTART_COUNT": "2" if spares else "0"}
    # All, the survivors from the killed step on, all again once rejoined; per kill.
    want = [(0, 1, 2), (0, 2), (0, 1, 2)] + ([(1, 2), (0, 1, 2)] if spares else [])
    assert [slots for _, slots in history] == want, history
    assert history[1][0] in (6, 7)  # the killed step runs again (or was finished by a peer)
    used = _read_logs(logs)
    ends = [start for start, _ in history[1:]] + [steps]
    for (start, slots), end in zip(history, ends):  # every member logged every step of its world
        assert {(step, slot) for step in range(start, end) for slot in slots} <= set(used)
    assert len(used) == sum((end - start) * len(slots)
                            for (start, slots), end in zip(history, ends))
    # The sample stream: every epoch that ended reads each sample at least once, and more than
    # once only for the padding of a re-sharded rest (at most world - 1 per world change).
    last = max(epoch for epoch, _ in used.values())
    for epoch in range(last):
        read = [i for e, indices in used.values() if e == epoch for i in indices]
        assert set(read) == set(range(len(_job().dataset())))
        assert len(read) - len(set(read)) <= 2 * (len(history) - 1), epoch
    # The same steps, given the same worlds and samples without any failure: equal bit for bit.
    phases = [(start, end, list(slots)) for (start, slots), end in zip(history, ends)]
    samples = {key: indices for key, (_, indices) in used.items()}
    lockstep.spawn(_replay, args=(phases, str(tmp_path), samples), nprocs=3, timeout=120,
                   start_method="forkserver")
    state = str(tmp_path / f"phase{phases[-1][0]}.pt")
    replayed = torch.load(state, weights_only=True)["params"]
    for got, want in zip(result["params"], replayed, strict=True):
        assert torch.equal(got, want)
    # The checkpoints went on across the changes of world: the last step's, read back by the
    # final world, holds the final parameters.
    restored_step, restored = result["restored"]
    assert restored_step == steps
    for got, want in zip(result["params"], restored, strict=True):
        assert torch.equal(got, want)


@pytest.mark.timeout(150)
def test_a_job_without_finish_ends_while_a_replacement_waits(tmp_path) -> None:
    # The replacement of the killed rank is never admitted (admit_every is beyond the end) and
    # the script never calls team.finish(): the launcher tells it the job is over once the
    # training ranks have ended (it waited for it until join_timeout, 10 minutes, before).
    logs = tmp_path / "logs"
    logs.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--survivors", "--max-restarts", "1",
         "--nproc-per-node", "2", str(SCRIPT), "--steps", "8", "--kill", "1:4",
         "--admit-every", "1000", "--no-finish", "--sleep", "0.2", "--out", str(tmp_path / "out.pt"),
         "--log-dir", str(logs)],
        check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a warm spare" in done.stderr
    assert [s for _, s in torch.load(tmp_path / "out.pt", weights_only=False)["history"]] == [
        (0, 1), (0,)]


def test_init_distributed_and_torchs_ddp_are_refused_where_survivors_are_needed(monkeypatch) -> None:
    team = lockstep.Survivors()  # not under --survivors: a world of one, as init_distributed
    try:
        torch_ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(TypeError, match="wrap the model in lockstep.DistributedDataParallel"):
            team.track(torch_ddp)
    finally:
        team.finish()
    monkeypatch.setenv("LOCKSTEP_SURVIVORS", "1")
    with pytest.raises(RuntimeError, match=r"team = lockstep.Survivors\(\)` instead of calling"):
        lockstep.init_distributed()


def test_peer_failures_are_told_from_the_programs_own_errors() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise RuntimeError("DDP gradient all-reduce (bucket 0 of 1) failed") from inner
    except RuntimeError as wrapped:
        assert is_peer_failure(wrapped)  # found through the cause
    assert is_peer_failure(dist.DistNetworkError("store went away"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("bad batch"))
    # gloo's own timeout is a peer's failure; a program's error that says "timed out" is not
    # (a DataLoader's: it took the other ranks down with it before 2026-11-28)
    assert is_peer_failure(RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms "
        "for recv operation to complete"))
    assert is_peer_failure(RuntimeError("NCCL communicator was aborted on rank 1."))
    for own in ("DataLoader timed out after 5 seconds", "socket closed by my own code?",
                "the peer review aborted"):
        assert not is_peer_failure(RuntimeError(own)), own


def test_a_member_lost_while_the_new_world_forms_is_a_peer_failure_at_once() -> None:
    # A replacement (or a second rank) that dies while the next group forms used to leave the
    # others in the group's rendezvous until its timeout (ten minutes): now the launcher's mark
    # of the dead ends the wait with a peer's failure, and the roll call follows.
    import types
    from datetime import timedelta

    store = dist.HashStore()
    members = (Member(0, 111, 6), Member(2, 333, -1))
    team = types.SimpleNamespace(_store=store, timeout=timedelta(seconds=30), pid=111)
    group_store = dist.PrefixStore("g1/pg/", store)
    store.set(dead_key(2, 333), "-9")
    with pytest.raises(dist.DistNetworkError, match=r"rank 2 \(pid 333\) died") as caught:
        Survivors._await_members(team, group_store, 0, members)  # type: ignore[arg-type]
    assert is_peer_failure(caught.value)
    group_store.set("lockstep-arrived/1", "333")  # both there: the group is made
    fresh = types.SimpleNamespace(_store=dist.HashStore(), timeout=timedelta(seconds=30), pid=111)
    Survivors._await_members(fresh, group_store, 0, members)  # type: ignore[arg-type]


def test_group_sockets_shut_down_the_connections_opened_between_the_marks() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    noted = GroupSockets()
    noted.before()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    noted.after()
    try:
        assert client.fileno() in noted.sockets and accepted.fileno() in noted.sockets
        assert server.fileno() not in noted.sockets  # opened before the first mark
        assert noted.shutdown() == 2
        client.settimeout(5)
        assert client.recv(1) == b""  # the peer sees the connection closed, at once
        assert noted.shutdown() == 0  # nothing noted any more
    finally:
        for sock in (client, accepted, server):
            sock.close()


def test_use_process_group_refuses_a_model_whose_hook_names_the_old_group() -> None:
    team = lockstep.Survivors()
    try:
        model = lockstep.DistributedDataParallel(torch.nn.Linear(2, 2))
        model.use_process_group(None)  # a world of one: nothing to rebuild, accepted
        model.register_comm_hook(None, lambda state, bucket: None)
        with pytest.raises(RuntimeError, match="registered comm hook"):
            model.use_process_group(None)
        with pytest.raises(TypeError, match="state_dict"):
            team.track(model, counter=object())
    finally:
        team.finish()
