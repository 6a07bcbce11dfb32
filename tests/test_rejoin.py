"""Leaving the default group and joining a new one in the same processes (lockstep.rejoin)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.rejoin import LeftGroups, PreviousStore, StoreStillOpenError, store_address


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)


def test_a_watch_ends_when_the_store_closes_and_says_so_when_it_does_not():
    port = _free_port()
    server = _server(port)
    client = dist.PrefixStore("default_pg", dist.PrefixStore("x", dist.TCPStore(
        "127.0.0.1", port, 2, False, timedelta(seconds=10))))
    assert store_address(client) == ("127.0.0.1", port)
    watch = PreviousStore.watch(client, rank=1, environ={})
    assert watch is not None and not watch.closed()
    with pytest.raises(StoreStillOpenError, match=rf"127.0.0.1:{port}, hosted by rank 0, is still open"):
        watch.wait_closed(0.2)

    watch = PreviousStore.watch(client, rank=1, environ={})
    assert watch is not None
    del server  # rank 0 destroys its group: the server closes its connections
    start = time.monotonic()
    watch.wait_closed(10.0)
    assert time.monotonic() - start < 5 and watch.closed()


def test_only_a_store_hosted_by_another_worker_is_watched():
    port = _free_port()
    server = _server(port)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    assert PreviousStore.watch(client, rank=0, environ={}) is None  # the host itself
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert PreviousStore.watch(client, rank=1, environ=agent) is None  # outlives the workers
    assert PreviousStore.watch(dist.HashStore(), rank=1, environ={}) is None  # a world of one
    del server


def test_groups_after_the_first_get_keys_of_their_own_and_other_ports_are_not_waited_for():
    port = _free_port()
    server = _server(port)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    left = LeftGroups()
    assert left.prefix() is None  # a first group: torch's own keys, unchanged
    left.left(client, rank=1)
    assert left.prefix() == "default_pg/lockstep-rejoin-1"
    start = time.monotonic()
    left.before_join(port + 1, timeout=30.0)  # another address: nothing to wait for
    assert time.monotonic() - start < 1.0 and left.store is None
    left.left(client, rank=1)
    with pytest.raises(StoreStillOpenError):
        left.before_join(port, timeout=0.2)
    assert left.prefix() == "default_pg/lockstep-rejoin-2"
    del server


def _three_groups(rank):
    sums = []
    for _ in range(3):
        lockstep.init_distributed(timeout=timedelta(seconds=30))
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        sums.append(t.item())
        lockstep.shutdown_distributed()  # rank 0, hosting the store, leaves last
    return sums


def test_spawned_ranks_leave_and_join_again():
    # Before lockstep.rejoin, rank 1 met the first group's store again and failed in gloo.
    assert lockstep.spawn(_three_groups, 2, timeout=120) == [[3.0, 3.0, 3.0]] * 2


def _groups_with_a_model_each(rank):
    """A sweep: each trial joins, trains a DDP model (lockstep's, then torch's), drops it and
    leaves. The models' hooks held rank 0's store open after the group was destroyed, so the
    second trial waited out its timeout (until 2026-11-29)."""
    sums = []
    for cls in (lockstep.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel,
                lockstep.DistributedDataParallel):
        lockstep.init_distributed(timeout=timedelta(seconds=20))
        model = cls(torch.nn.Linear(2, 2))
        model(torch.ones(3, 2)).sum().backward()
        sums.append(sum(p.grad.sum().item() for p in model.parameters()))
        del model
        gc.collect()
        lockstep.shutdown_distributed()
    return sums


def test_ranks_that_trained_a_model_join_again():
    sums = lockstep.spawn(_groups_with_a_model_each, 2, timeout=150)
    assert sums[0] == sums[1] and len(sums[0]) == 3


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, lockstep
    from datetime import timedelta
    for _ in range(3):
        lockstep.init_distributed(timeout=timedelta(seconds=30))
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        print("sum", t.item(), flush=True)
        lockstep.shutdown_distributed()
""")


def test_workers_of_a_launcher_leave_and_join_again(tmp_path):
    # The agent's store keeps the first group's keys: a later group needs its own.
    script = tmp_path / "rejoin.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=150, env=env, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("sum 3.0") == 6, done.stdout
