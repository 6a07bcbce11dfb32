"""Who-am-I detection, init_distributed and spawn."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.env import detect_process_info, expand_slurm_nodelist


def test_no_launcher_is_a_world_of_one():
    info = detect_process_info({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


def test_torchrun_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    info = detect_process_info(env)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert (info.master_addr, info.master_port, info.source) == ("node0", 1234, "torchrun")


def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "gpu[03-04,09]", "SLURM_JOB_ID": "4242", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    info = detect_process_info(env)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (5, 1, 8, 4)
    assert info.master_addr == "gpu03" and info.source == "slurm"
    assert info.master_port == detect_process_info(dict(env, SLURM_PROCID="0")).master_port


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_process_info(env).source == "torchrun"


def test_expand_nodelist():
    assert expand_slurm_nodelist("a[1-3],b07,c[08-10]x") == ["a1", "a2", "a3", "b07", "c08x", "c09x", "c10x"]
    # Several bracket groups in one name, as scontrol show hostnames expands them (the second
    # group was copied as it was: MASTER_ADDR 'rack1-node[01,03]', found by an outside audit).
    assert expand_slurm_nodelist("rack[1-2]-node[01,03],gpu-[7].dom") == [
        "rack1-node01", "rack1-node03", "rack2-node01", "rack2-node03", "gpu-7.dom"]


@pytest.mark.parametrize("env, culprit", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
    ({"RANK": "1"}, "RANK is set .'1'. but WORLD_SIZE is not"),  # was a world of one, rank 0
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "node[01-x]"},
     "SLURM_NODELIST='node\\[01-x\\]' is not a node list"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set .'2'. but RANK is not"),
])
def test_bad_environment_is_named(env, culprit):
    with pytest.raises(ValueError, match=culprit):
        detect_process_info(env)


def test_init_distributed_single_process_twice():
    first = lockstep.init_distributed()
    try:
        second = lockstep.init_distributed()
        assert first.world_size == second.world_size == 1
        assert first.backend == "gloo" and first.device == torch.device("cpu")
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        # a later call names the device asked for then (it said "cpu" for any device before)
        assert lockstep.init_distributed(device="meta").device == torch.device("meta")
        assert lockstep.init_distributed(backend="gloo").backend == "gloo"
        with pytest.raises(ValueError, match="already exists with backend 'gloo'.*shutdown_distributed"):
            lockstep.init_distributed(backend="nccl")  # was silently ignored
    finally:
        lockstep.shutdown_distributed()


def _sum_of_ranks(rank, offset):
    info = lockstep.init_distributed()
    t = torch.tensor([float(info.rank)])
    dist.all_reduce(t)
    return info.rank, info.world_size, t.item() + offset


def test_spawn_forms_one_world():
    assert lockstep.spawn(_sum_of_ranks, 3, (10,), timeout=90) == [(r, 3, 13.0) for r in range(3)]


def _loader_with_workers(rank):
    # Ranks are not daemons: a DataLoader may start worker processes, as under torch's spawn.
    loader = torch.utils.data.DataLoader(torch.arange(8.0), batch_size=4, num_workers=2)
    return sum(float(b.sum()) for b in loader)


def test_spawn_ranks_may_start_processes_of_their_own():
    assert lockstep.spawn(_loader_with_workers, 1, timeout=90) == [28.0]
    with pytest.raises(TypeError, match=r"args= must be a tuple .*e.g. args=\(5,\)"):
        lockstep.spawn(_loader_with_workers, 1, args=5)  # type: ignore[arg-type]


def _rank1_raises(rank):
    lockstep.init_distributed()
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait forever without spawn stopping it


def test_spawn_carries_exception_and_stops_survivors():
    with pytest.raises(lockstep.WorkerError, match="rank 1 raised ValueError: deliberate") as err:
        lockstep.spawn(_rank1_raises, 2, timeout=90)
    assert err.value.rank == 1


def _rank0_dies(rank):
    import os
    lockstep.init_distributed()
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_spawn_reports_a_dead_worker():
    with pytest.raises(lockstep.WorkerError, match="rank 0 died with exit code 7"):
        lockstep.spawn(_rank0_dies, 2, timeout=90)


def _leaves_a_thread_running(rank):
    import threading
    import time

    threading.Thread(target=time.sleep, args=(600,), name="never-ends").start()  # not a daemon
    return rank


def test_spawn_kills_a_rank_whose_threads_outlast_the_timeout(caplog):
    """A rank that returned is let exit by itself while threads of its own run (a checkpoint
    being written), but never past the spawn's timeout."""
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="lockstep.launcher.spawn"):
        assert lockstep.spawn(_leaves_a_thread_running, 1, timeout=6) == [0]
    assert time.monotonic() - start < 30
    assert "rank 0 still ran never-ends when the timeout expired: killed" in caplog.text


def _listening_ports_of_this_process() -> list[str]:
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
        try:
            target = os.readlink(f"/proc/{os.getpid()}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    local = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    local.append(fields[1].split(":")[0])
    return local


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_world_of_one_listens_on_loopback_only():
    lockstep.init_distributed()
    try:
        t = torch.ones(1)
        dist.all_reduce(t)
        addresses = _listening_ports_of_this_process()
        # 0100007F is 127.0.0.1 in /proc's little-endian hex; IPv6 loopback is ...01000000.
        assert all(a in ("0100007F", "00000000000000000000000001000000") for a in addresses), addresses
    finally:
        lockstep.shutdown_distributed()


def test_slurm_tasks_per_node_forms():
    from lockstep.env import expand_slurm_tasks_per_node

    assert expand_slurm_tasks_per_node("2(x2)") == [2, 2]
    assert expand_slurm_tasks_per_node("4,2(x3)") == [4, 2, 2, 2]
    assert expand_slurm_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_slurm_tasks_per_node("two")


def test_slurm_local_world_size_without_ntasks_per_node():
    """srun -n 4 over 2 nodes: every rank sees 2 workers on its node (not local_rank + 1)."""
    base = {"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "n[1-2]"}
    sizes = []
    for rank in range(4):
        env = dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2),
                   SLURM_NODEID=str(rank // 2))
        sizes.append(detect_process_info(env).local_world_size)
    assert sizes == [2, 2, 2, 2]
    # Uneven nodes, node id derived from the block distribution when SLURM_NODEID is absent.
    uneven = {"SLURM_NTASKS": "10", "SLURM_TASKS_PER_NODE": "4,2(x3)", "SLURM_NODELIST": "n[1-4]"}
    got = [detect_process_info(dict(uneven, SLURM_PROCID=str(r))).local_world_size
           for r in range(10)]
    assert got == [4] * 4 + [2] * 6
    step = dict(uneven, SLURM_STEP_TASKS_PER_NODE="5,5", SLURM_PROCID="7", SLURM_NODEID="1")
    assert detect_process_info(step).local_world_size == 5


def test_env_int_one_parser_for_every_variable():
    from lockstep.env import env_int, parse_env_int

    assert env_int({}, "X", 5) == 5
    assert env_int({"X": ""}, "X", 5) == 5
    assert env_int({"X": "7"}, "X", 5, least=1) == 7
    with pytest.raises(ValueError, match=r"environment variable X='ten' is not a whole number; "
                                         r"unset it or give e\.g\. X=40"):
        env_int({"X": "ten"}, "X", example=40)
    with pytest.raises(ValueError, match="X=0: must be at least 1"):
        env_int({"X": "0"}, "X", least=1)
    with pytest.raises(ValueError, match="environment variable RANK='a' is not a whole number"):
        parse_env_int("RANK", "a")


def test_loopback_gloo_keeps_the_users_choice():
    from lockstep.env import loopback_gloo, loopback_interface

    assert loopback_gloo({"GLOO_SOCKET_IFNAME": "eth0"}) == {}
    name = loopback_interface()
    assert loopback_gloo({}) == ({} if name is None else {"GLOO_SOCKET_IFNAME": name})
