"""Tests for `lockstep run` (lockstep/cli.py, lockstep/launcher/).

Tiers: argument validation, root-cause ordering and the loopback store without processes;
then real launches through `python -m lockstep run` on gloo/CPU (a world of 2, a failing
worker, a restart, two nodes on loopback, plain python); a GPU launch with `auto`.
Each launch costs seconds of interpreter start-up, so each one checks several things.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lockstep.cli import build_parser, main
from lockstep.launcher import config, errors, rendezvous, stores
from lockstep.launcher.output import OutputRelay, PrefixWriter
from lockstep.launcher.run import scoped_environ

JOB = Path(__file__).parent / "scripts" / "launcher" / "job.py"
LAUNCH_TIMEOUT = 120  # seconds; a launch that takes longer is a hang, not slowness


# ----------------------------------------------------------------------------- argument errors


def _args(*argv: str):
    return build_parser().parse_args(["run", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "0", "JOB"], "--nproc-per-node 0: a machine needs at least 1 worker"),
        (["--nproc-per-node", "many", "JOB"], "--nproc-per-node 'many' is not a number, 'auto', 'cpu' or 'gpu'"),
        (["--nnodes", "0", "JOB"], "--nnodes '0': need 1 <= MIN <= MAX"),
        (["--nnodes", "3:2", "JOB"], "--nnodes '3:2': need 1 <= MIN <= MAX"),
        (["--nnodes", "two", "JOB"], "--nnodes 'two' is not N or MIN:MAX"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "JOB"],
            "--node-rank 2 is outside [0, 2) for --nnodes 2",
        ),
        (["--node-rank", "-1", "JOB"], "--node-rank -1 is outside [0, 1)"),
        (["--max-restarts", "-1", "JOB"], "--max-restarts -1: must be 0 or more"),
        (["--monitor-interval", "0", "JOB"], "--monitor-interval 0.0: must be positive"),
        (["no_such_script.py"], "training script 'no_such_script.py' does not exist"),
        # Checked up front since 2026-11-29 (every worker started, then failed to import it).
        (["-m", "no_such_module_xyz.train"], "-m no_such_module_xyz.train: no module named 'no_such"),
        (["--rdzv-endpoint", "host:port", "JOB"], "has a port 'port' that is not a number"),
        (["--rdzv-endpoint", "host:", "JOB"], "has a port '(empty)' that is not a number"),
        (["--rdzv-endpoint", ":29400", "JOB"], "':29400' has no valid host"),
        (["--rdzv-endpoint", "h:70000", "JOB"], "has a port 70000 outside 0-65535"),
        (["--nnodes", "2", "JOB"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (
            ["--standalone", "--rdzv-endpoint", "127.0.0.1:29400", "--nnodes", "2", "JOB"],
            "--standalone runs on one machine but --nnodes 2 asks for 2",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:0", "JOB"], "port 0 cannot be shared"),
        (["--rdzv-conf", "timeout", "JOB"], "'timeout' is not KEY=VALUE"),
        # Until 2026-11-29 torch's ValueError surfaced as a launcher traceback (exit 1).
        (["--rdzv-conf", "join_timeout=abc", "JOB"], "join_timeout takes a whole number"),
        (["--rdzv-conf", "is_host=maybe", "JOB"], "is_host takes 1 or 0"),
        (["--no-python", "no_such_program_xyz", "JOB"],
         "--no-python program 'no_such_program_xyz' is not found on PATH"),
        (["--no-python", "./no_such_program_xyz", "JOB"], "does not exist: looked for"),
        (["--no-python", str(JOB), "JOB"], "is not executable: chmod +x"),
        (["--local-ranks-filter", "a", "JOB"], "--local-ranks-filter 'a' is not a list"),
        (["--survivors", "--max-restarts", "1", "--nnodes", "1:2", "--rdzv-endpoint",
          "10.0.0.1:29400", "JOB"], "--survivors needs a fixed number of machines"),
        (["--survivors", "--max-restarts", "1", "--nnodes", "2", "--rdzv-endpoint",
          "10.0.0.1:29400", "--node-timeout", "0", "JOB"], "--node-timeout 0.0: must be positive seconds"),
        (["--survivors", "--max-restarts", "1", "--spares", "-1", "JOB"], "--spares -1: must be 0 or more"),
        (["--survivors", "JOB"], "with --max-restarts 0 the first failure would stop the whole job"),
        (["--survivors", "--max-restarts", "2", "--log-dir", "logs", "JOB"],
         "--log-dir is not supported with --survivors"),
        (["--spares", "2", "JOB"], "--spares only applies with --survivors"),
        (["--node-timeout", "5", "--spares", "0", "JOB"],
         "--spares and --node-timeout only apply with --survivors"),
    ],
)
def test_argument_errors_name_the_flag(argv, message, capsys):
    argv = [str(JOB) if a == "JOB" else a for a in argv]
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep run: error: ")
    assert message in err


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "run" in capsys.readouterr().err


def test_folder_as_script_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist \\(it is a folder\\)"):
        config.plan_from_args(_args(str(tmp_path)))


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-1.cluster", ("node-1.cluster", config.DEFAULT_RDZV_PORT)),
        ("[::1]:1234", ("::1", 1234)),
        ("[fe80::1]", ("fe80::1", config.DEFAULT_RDZV_PORT)),
    ],
)
def test_parse_endpoint(endpoint, expected):
    assert config.parse_endpoint(endpoint) == expected


def test_parse_nnodes():
    assert config.parse_nnodes("2") == (2, 2)
    assert config.parse_nnodes("1:4") == (1, 4)
    with pytest.raises(ValueError, match="is not N or MIN:MAX"):
        config.parse_nnodes("1:2:3")


# ------------------------------------------------------------------------------ launch plans


def test_no_fork_is_parsed_and_the_start_method_follows_the_plan(tmp_path):
    forked = config.plan_from_args(_args("--max-restarts", "2", str(JOB)), environ={})
    fresh = config.plan_from_args(_args("--max-restarts", "2", "--no-fork", str(JOB)), environ={})
    assert forked.fork_workers and not fresh.fork_workers
    assert config.to_launch_config(forked, str(tmp_path), start_method="forkserver") \
        .start_method == "forkserver"
    assert config.to_launch_config(fresh, str(tmp_path)).start_method == "spawn"  # torch's default


def test_torchruns_agent_flags_reach_the_agent(tmp_path):
    """torchrun 2.13's agent flags run unchanged and reach LaunchConfig; defaults add nothing."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    assert config.plan_from_args(_args(str(JOB)), environ={}).agent_options == {}
    wanted = {"shutdown_timeout": 7, "signals_to_handle": "SIGTERM,SIGUSR1", "virtual_local_rank": True,
              "duplicate_stdout_filters": ["loss", "step"], "event_log_handler": "console"}
    flags = ("--shutdown-timeout", "7", "--signals_to_handle", "SIGTERM,SIGUSR1", "--virtual-local-rank",
             "--duplicate-stdout-filters", "loss,step", "--event-log-handler", "console")
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    if not set(wanted) <= known:  # an older torch: the flags are refused, naming torch
        with pytest.raises(ValueError, match="elastic agent has no such setting"):
            config.plan_from_args(_args(*flags, str(JOB)), environ={})
        return
    plan = config.plan_from_args(_args(*flags, str(JOB)), environ={})
    launch = config.to_launch_config(plan, str(tmp_path))
    assert {name: getattr(launch, name) for name in wanted} == wanted
    with pytest.raises(ValueError, match="--logs-specs is not supported"):
        config.plan_from_args(_args("--logs-specs", "x", str(JOB)), environ={})
    with pytest.raises(ValueError, match="--shutdown-timeout -1"):
        config.plan_from_args(_args("--shutdown-timeout", "-1", str(JOB)), environ={})
    with pytest.raises(ValueError, match="which --survivors does not use"):
        config.plan_from_args(_args("--survivors", "--max-restarts", "1", "--virtual-local-rank", str(JOB)),
                              environ={})


def test_torchruns_pet_variables_are_defaults_and_flags_win(monkeypatch):
    """Kubeflow's PyTorchJob (and torchrun) give flags as PET_<FLAG> variables."""
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")
    monkeypatch.setenv("PET_SPARES", "5")  # lockstep's own flag: torchrun has no such variable
    args = _args(str(JOB))
    assert (args.nproc_per_node, args.max_restarts, args.virtual_local_rank, args.spares) == ("3", 2, True, None)
    assert _args("--nproc-per-node", "1", str(JOB)).nproc_per_node == "1"
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    with pytest.raises(ValueError, match="--rdzv-backend 'etcd' \\(or PET_RDZV_BACKEND\\) is not supported"):
        config.plan_from_args(_args(str(JOB)), environ={})
    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(SystemExit, match="PET_STANDALONE='yes'"):
        _args(str(JOB))


def test_nproc_per_node_cpu_and_gpu_as_torchrun(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    assert config.plan_from_args(_args("--nproc-per-node", "cpu", str(JOB)), environ={}).nproc_per_node == cores
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--nproc-per-node gpu: CUDA is not available"):
        config.plan_from_args(_args("--nproc-per-node", "gpu", str(JOB)), environ={})


def test_single_machine_plan_stays_on_loopback(tmp_path):
    plan = config.plan_from_args(_args("--nproc-per-node", "2", str(JOB), "ok", "x"), environ={})
    assert plan.rdzv_backend == rendezvous.LOOPBACK_BACKEND
    assert plan.rdzv_endpoint == "127.0.0.1:0"
    assert plan.local_addr == "127.0.0.1"
    assert plan.entrypoint == sys.executable
    assert plan.args == ("-u", "-m", "lockstep.launcher.worker", str(JOB), "ok", "x")
    assert plan.max_restarts == 0 and plan.nproc_per_node == 2
    assert plan.worker_env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    if "lo" in {name for _, name in socket.if_nameindex()}:
        assert plan.worker_env["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in config.loopback_gloo({"GLOO_SOCKET_IFNAME": "eth0"})
    launch = config.to_launch_config(plan, log_dir=str(tmp_path))
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (1, 1, 2)
    assert launch.logs_specs.root_log_dir == str(tmp_path)
    assert launch.rdzv_backend == rendezvous.LOOPBACK_BACKEND


def test_single_machine_keeps_the_rdzv_id_as_torchrun_does():
    """TORCHELASTIC_RUN_ID is the --rdzv-id on one machine too ("none" by default, as
    torchrun's); --standalone makes a fresh one (it was a fresh one every launch)."""
    given = config.plan_from_args(_args("--nproc-per-node", "1", "--rdzv-id", "myjob", str(JOB)), environ={})
    assert given.run_id == "myjob"
    assert config.plan_from_args(_args("--nproc-per-node", "1", str(JOB)), environ={}).run_id == "none"
    standalone = config.plan_from_args(_args("--standalone", "--rdzv-id", "myjob", str(JOB)), environ={})
    assert standalone.run_id != "myjob" and len(standalone.run_id) == 32


def test_multi_machine_plans():
    remote = config.plan_from_args(
        _args(
            "--nnodes",
            "1:3",
            "--rdzv-endpoint",
            "10.1.2.3",
            "--rdzv-id",
            "job7",
            "--max-restarts",
            "2",
            "-m",
            "json.tool",
        ),
        environ={"OMP_NUM_THREADS": "4"},
    )
    assert remote.rdzv_backend == rendezvous.C10D_BACKEND
    assert remote.rdzv_endpoint == "10.1.2.3:29400"
    assert (remote.min_nodes, remote.max_nodes, remote.run_id) == (1, 3, "job7")
    assert remote.local_addr is None
    assert remote.args[-2:] == ("-m", "json.tool")
    assert "OMP_NUM_THREADS" not in remote.worker_env  # the user chose it
    loop = config.plan_from_args(
        _args("--nnodes", "2", "--rdzv-endpoint", "localhost:29555", str(JOB)), environ={}
    )
    assert loop.rdzv_backend == rendezvous.LOOPBACK_BACKEND
    static = config.plan_from_args(
        _args(
            "--rdzv-backend",
            "static",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            "29511",
            "--no-python",
            "/bin/true",
        ),
        environ={},
    )
    assert (static.rdzv_backend, static.rdzv_endpoint) == ("static", "127.0.0.1:29511")
    assert static.rdzv_configs["rank"] == 1
    assert (static.entrypoint, static.args) == ("/bin/true", ())


def test_omp_threads_only_when_workers_share_cores():
    mine = {"LOCKSTEP_OMP_FROM_LAUNCHER": "0"}  # the count is not the launcher's choice
    assert config.omp_threads(1, {}) == mine
    assert config.omp_threads(4, {"OMP_NUM_THREADS": "8"}) == mine
    assert config.omp_threads(64, {})["LOCKSTEP_OMP_FROM_LAUNCHER"] == "1"
    threads = int(config.omp_threads(64, {})["OMP_NUM_THREADS"])
    assert threads == max(1, len(os.sched_getaffinity(0)) // 64) >= 1


def test_virtual_shards_give_every_world_the_same_thread_count():
    # A CPU reduction's bits depend on its threads: the same count at every world size of V=4.
    counts = {config.plan_from_args(_args("--virtual-shards", "4", "--nproc-per-node", str(n), str(JOB)),
                                    environ={}).worker_env["OMP_NUM_THREADS"] for n in (1, 2, 4)}
    assert counts == {str(max(1, len(os.sched_getaffinity(0)) // 4))}
    assert "OMP_NUM_THREADS" not in config.omp_threads(1, {"OMP_NUM_THREADS": "3"}, virtual_shards=4)


def test_auto_nproc_without_gpus():
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert config.auto_nproc() == expected


def test_scoped_environ_restores():
    key = "LOCKSTEP_TEST_" + uuid.uuid4().hex
    with scoped_environ({key: "1", "PATH": "/x"}):
        assert os.environ[key] == "1" and os.environ["PATH"] == "/x"
    assert key not in os.environ and os.environ["PATH"] != "/x"


# ------------------------------------------------------------------------------- root cause


def _error_file(path: Path, message: str, callstack: str, timestamp: int) -> str:
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)},
        }
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def test_root_cause_prefers_the_real_error_over_its_echoes(tmp_path):
    t = int(time.time())
    echo = _error_file(
        tmp_path / "r0" / "error.json",
        "RuntimeError: Connection closed by peer [127.0.0.1]:1",
        'Traceback (most recent call last):\n  File "<frozen runpy>", line 88, in _run_code\n'
        '  File "train.py", line 9, in <module>\n    dist.barrier()\n'
        "RuntimeError: Connection closed by peer [127.0.0.1]:1\n",
        t - 1,
    )
    real = _error_file(
        tmp_path / "r1" / "error.json",
        "ValueError: bad batch",
        'Traceback (most recent call last):\n  File "/x/runpy.py", line 1, in run_path\n'
        "    exec(code)\n"
        '  File "train.py", line 5, in <module>\n    raise ValueError("bad batch")\n'
        "ValueError: bad batch\n",
        t,
    )
    err = ChildFailedError(
        "train.py",
        {
            0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=echo),
            1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=real),
            2: ProcessFailure(local_rank=2, pid=12, exitcode=-signal.SIGTERM, error_file="none"),
        },
    )
    failures = errors.failures_from(err)
    assert [f.rank for f in failures] == [1, 2, 0]
    report = errors.format_report(failures, attempts=2)
    assert "failed after 2 attempts" in report
    assert "Root cause: rank 1 (local rank 1, pid 11) ended with exit code 1." in report
    assert 'raise ValueError("bad batch")' in report and "runpy" not in report
    assert "rank 2 (signal SIGTERM (15)), rank 0 (exit code 1)" in report
    assert errors.exit_code_for(failures[0]) == 1


def test_ranks_that_raised_their_own_error_are_not_called_a_consequence(tmp_path):
    """Every rank raised its own exception: the first is the root cause, the others are listed
    with what they raised (they were "probably a consequence" until 2026-11-29); a rank that
    only lost its peer still is."""
    t = int(time.time())
    files = {
        rank: _error_file(tmp_path / f"r{rank}" / "error.json", summary,
                          f'Traceback (most recent call last):\n  File "train.py", line 5, in '
                          f"<module>\n{summary}\n", t + rank)
        for rank, summary in [(0, "KeyError: 'label'"), (1, "ValueError: rank 1's own problem"),
                              (2, "RuntimeError: Connection closed by peer [127.0.0.1]:1")]
    }
    err = ChildFailedError("train.py", {
        rank: ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=1, error_file=path)
        for rank, path in files.items()})
    report = errors.format_report(errors.failures_from(err))
    assert "Root cause: rank 0 (local rank 0, pid 10) ended with exit code 1." in report
    assert ("Also failed with an error of its own: rank 1 (exit code 1: ValueError: rank 1's own "
            "problem).") in report
    assert "Also failed, probably as a consequence: rank 2 (exit code 1)." in report


def test_a_gloo_timeout_is_a_consequence_of_the_rank_it_waited_for(tmp_path):
    """Rank 0 hit gloo's own timeout waiting for rank 1, which hung until the agent stopped it:
    rank 1 is the root cause (rank 0 was, as "an error of its own", until 2026-11-29)."""
    t = int(time.time())
    timeout = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
               "Timed out waiting 30000ms for recv operation to complete")
    waited = _error_file(tmp_path / "r0" / "error.json", timeout,
                         'Traceback (most recent call last):\n  File "train.py", line 9, in '
                         f"<module>\n    dist.all_reduce(t)\n{timeout}\n", t)
    err = ChildFailedError("train.py", {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=waited),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGTERM, error_file="none"),
    })
    failures = errors.failures_from(err)
    assert [f.rank for f in failures] == [1, 0]
    assert "Also failed, probably as a consequence: rank 0 (exit code 1)." in errors.format_report(failures)


def test_a_machine_whose_workers_only_lost_a_peer_says_the_cause_is_elsewhere(tmp_path):
    """Two machines: rank 1 raised on machine B; machine A's rank 0 failed on the closed
    connection. A's report said "Root cause: rank 0 ... exit code 1", naming no host."""
    echo = _error_file(
        tmp_path / "r0" / "error.json", "RuntimeError: Connection closed by peer [10.0.0.2]:5",
        'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        "    dist.all_reduce(t)\nRuntimeError: Connection closed by peer [10.0.0.2]:5\n",
        int(time.time()),
    )
    err = ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=10, exitcode=1,
                                                          error_file=echo)})
    failures = errors.failures_from(err)
    report = errors.format_report(failures, host="machine-a")
    assert ("Root cause: not on this machine. Rank 0 (local rank 0, pid 10, on machine-a) ended "
            "with exit code 1 because it lost its connection to a peer") in report, report
    assert "Connection closed by peer" in report
    alone = errors.format_report(failures)  # one machine: the rank is named as before
    assert "Root cause: rank 0 (local rank 0, pid 10) ended with exit code 1." in alone


def test_root_cause_of_a_killed_worker_shows_its_last_lines(tmp_path):
    log = tmp_path / "run_x" / "attempt_1" / "3" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "out of memory, probably\n")
    err = ChildFailedError(
        "train.py",
        {
            7: ProcessFailure(local_rank=3, pid=13, exitcode=-signal.SIGKILL, error_file="none"),
        },
    )
    failures = errors.failures_from(err, str(tmp_path))
    report = errors.format_report(failures)
    assert "Root cause: rank 7 (local rank 3, pid 13) ended with signal SIGKILL (9)." in report
    assert report.rstrip().endswith("out of memory, probably") and "line 5\n" not in report
    assert errors.exit_code_for(failures[0]) == 128 + 9


# ------------------------------------------------------------------------- loopback rendezvous


def _listening_hosts(port: int) -> set[str]:
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    hosts.add(local.rsplit(":", 1)[0])
    return hosts


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
@pytest.mark.parametrize("libuv", [True, False], ids=["libuv-store", "classic-store"])
def test_loopback_store_listens_on_127_0_0_1_and_is_shared(libuv, monkeypatch):
    from datetime import timedelta

    # torch < 2.8 takes the classic store's path; check both on this torch.
    monkeypatch.setattr(stores, "_LIBUV_TAKES_LISTEN_FD", libuv)

    server = rendezvous.loopback_store(0, timedelta(seconds=10))
    assert _listening_hosts(server.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    client = rendezvous.loopback_store(server.port, timedelta(seconds=10))  # port taken: joins
    client.set("key", "value")
    assert server.get("key") == b"value"
    with pytest.raises(RuntimeError, match="is taken; cannot host"):
        rendezvous.loopback_store(server.port, timedelta(seconds=10), host=True)
    assert rendezvous.is_loopback_host("localhost") and rendezvous.is_loopback_host("::1")
    assert not rendezvous.is_loopback_host("10.0.0.1")


def test_trim_traceback_keeps_the_users_frames():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/site/lockstep/launcher/worker.py", line 3, in main\n    run_script()\n'
        '  File "<frozen runpy>", line 88, in _run_code\n'
        '  File "train.py", line 2, in <module>\n    1 / 0\n'
        "ZeroDivisionError: division by zero"
    )
    assert errors.trim_traceback(text) == (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 2, in <module>\n    1 / 0\n'
        "ZeroDivisionError: division by zero"
    )


def test_trim_traceback_shows_a_named_collective_error_without_the_backends_story():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/site/lockstep/diagnose/hang.py", line 115, in wait\n    return future.wait()\n'
        "RuntimeError: Read error: Connection reset by peer. GLHF!\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 9, in <module>\n    loss.backward()\n'
        "lockstep.diagnose.hang.CollectiveTimeoutError: rank 0: ... rank 1 on host-b is gone"
    )
    trimmed = errors.trim_traceback(text)
    assert "GLHF" not in trimmed and trimmed.startswith("Traceback (most recent call last):")
    assert trimmed.endswith("rank 1 on host-b is gone")


# ------------------------------------------------------------------------------------ output


def test_prefix_writer_keeps_lines_whole_and_redraws_in_place():
    out, err = io.StringIO(), io.StringIO()
    writer = PrefixWriter()
    writer.write("a", "[a] ", "hel", out)
    writer.write("a", "[a] ", "lo\nwor", out)
    writer.write("a", "[a] ", "ld\r\n", out)
    assert out.getvalue() == "[a] hello\n[a] world\n"
    writer.write("bar", "[0] ", "\r 10%|#", err)
    writer.write("bar", "[0] ", "  |\r 20%|##  |", err)
    # Another rank's line arrives while the bar is drawn: the bar's line ends first.
    writer.write("b", "[b] ", "done\n", out)
    writer.write("bar", "[0] ", "\r100%|####|\n", err)
    assert err.getvalue() == "\r[0]  10%|#  |\r[0]  20%|##  |\n\r[0] 100%|####|\n"
    assert out.getvalue().endswith("[b] done\n")


def test_output_relay_names_each_worker_by_global_rank(tmp_path):
    attempt = tmp_path / "run_1" / "attempt_0"
    for local in ("0", "1", "2"):
        (attempt / local).mkdir(parents=True)
    (attempt / "0" / "rank").write_text("4")
    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay(str(tmp_path), local_ranks=[0, 1], stdout=out, stderr=err)
    (attempt / "0" / "stdout.log").write_bytes("tok/s \u2588".encode()[:-1])  # cut mid-character
    (attempt / "1" / "stderr.log").write_bytes(b"warning\n")
    (attempt / "2" / "stdout.log").write_bytes(b"filtered out\n")
    relay.poll()
    with open(attempt / "0" / "stdout.log", "ab") as fh:
        fh.write("\u2588".encode()[-1:] + b"\n")
    relay.poll()
    # Local rank 1's line came while rank 4's was open: rank 4's line ends, its rest is prefixed.
    assert out.getvalue() == "[rank4]: tok/s \n[rank4]: \u2588\n"
    assert err.getvalue() == "[local1]: warning\n"
    with relay:  # the thread starts and stops cleanly, draining on exit
        pass


def test_output_relay_reads_a_new_round_s_file_from_its_start(tmp_path):
    """A machine joins: the workers restart into a new round with the same restart count, and
    torch makes attempt_0 again. The old file's last line and all of the new one are shown (the
    new file was read from the old one's length on: its first lines were lost)."""
    import shutil

    attempt = tmp_path / "run_1" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay(str(tmp_path), stdout=out, stderr=err)
    log = attempt / "0" / "stdout.log"
    with open(log, "wb") as old:
        old.write(b"step 0 of the first round, a long line\n")
        old.flush()
        relay.poll()
        old.write(b"its last line\n")
        old.flush()
        shutil.rmtree(attempt)  # the new round: torch removes the folder and makes it again
        (attempt / "0").mkdir(parents=True)
        log.write_bytes(b"ENV\nstep 0\n")
        relay.poll()
    assert out.getvalue() == ("[local0]: step 0 of the first round, a long line\n"
                              "[local0]: its last line\n[local0]: ENV\n[local0]: step 0\n")
    with relay:
        pass


# --------------------------------------------------------------------------- real launches


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST")
    }
    env.update(extra)
    return env


def _lockstep_run(*argv: str, env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", *argv],
        check=False,
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )


def _reports(outdir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in outdir.glob("rank*.json")}


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.multirank
def test_world_of_two_completes_on_loopback(tmp_path):
    # The script named relative to the working directory, with torchrun's output and role
    # flags: it sees an absolute __file__ as under `python job.py` and torchrun.
    done = _lockstep_run("--nproc-per-node", "2", "--role", "trainer", "--tee", "3", "-r", "3",
                         "--run-path", "--start-method", "spawn", JOB.name, "ok", str(tmp_path),
                         cwd=JOB.parent)
    assert done.returncode == 0, done.stderr
    assert "[rank0]: hello from rank 0 of 2" in done.stdout
    assert "[rank1]: hello from rank 1 of 2" in done.stdout
    reports = _reports(tmp_path)
    assert sorted(reports) == ["rank0_attempt0", "rank1_attempt0"]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for rank in (0, 1):
        report = reports[f"rank{rank}_attempt0"]
        assert report["sum"] == 3.0
        assert report["env"] | {"TORCHELASTIC_RUN_ID": None} == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": threads,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_RUN_ID": None,
            "ROLE_NAME": "trainer",
        }
        assert report["file"] == str(JOB)
        # The worker's own sockets and its launcher's (both stores): loopback only.
        assert report["listening"], "found no listening socket to check"
        assert {addr.rsplit(":", 1)[0] for addr in report["listening"]} <= {
            "0100007F",
            "0000000000000000FFFF00000100007F",
        }, report["listening"]


@pytest.mark.multirank
def test_failing_worker_stops_the_job_with_its_traceback(tmp_path):
    marker = f"marker-{uuid.uuid4().hex}"
    done = _lockstep_run("--nproc-per-node", "2", str(JOB), "fail", str(tmp_path), marker)
    ended = time.time()
    assert done.returncode == 1, done.stderr
    report = done.stderr[done.stderr.index("lockstep run: the job failed") :]
    assert "Root cause: rank 1 (local rank 1," in report
    assert "ended with exit code 1." in report
    assert 'raise ValueError("rank 1 fails on purpose")' in report
    assert "ValueError: rank 1 fails on purpose" in report
    assert "runpy" not in report
    # Rank 0 was waiting in a barrier that never completes: the launcher stopped it.
    assert ended - float((tmp_path / "failing_at").read_text()) < 30
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == [], "workers outlived the launcher"


@pytest.mark.slow
@pytest.mark.multirank
def test_max_restarts_restarts_every_worker_after_a_kill(tmp_path):
    done = _lockstep_run(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(JOB),
        "kill-once",
        str(tmp_path),
        env=_env(OMP_NUM_THREADS="3"),
    )
    assert done.returncode == 0, done.stderr
    reports = _reports(tmp_path)
    assert sorted(reports) == [f"rank{r}_attempt{a}" for r in (0, 1) for a in (0, 1)]
    for rank in (0, 1):
        again = reports[f"rank{rank}_attempt1"]
        assert again["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert again["env"]["OMP_NUM_THREADS"] == "3"  # the user's choice is kept
        assert again["sum"] == 3.0
        assert again["pid"] != reports[f"rank{rank}_attempt0"]["pid"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.multirank
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
@pytest.mark.parametrize("restarts", ["0", "1"], ids=["new-interpreters", "forked"])
def test_workers_die_with_a_killed_launcher(tmp_path, restarts):
    marker = f"marker-{uuid.uuid4().hex}"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",  # with restarts, workers are forked from the launcher's server
            restarts,
            str(JOB),
            "hang",
            str(tmp_path),
            marker,
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while len(_reports(tmp_path)) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, "the launcher ended before its workers started"
            time.sleep(0.2)
        workers = [r["pid"] for r in _reports(tmp_path).values()]
        assert len(workers) == 2
        launcher.kill()  # SIGKILL: torch's agent gets no chance to stop its workers
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "workers outlived their killed launcher"
        assert _processes_with(marker) == []
    finally:
        launcher.kill()
        for pid in [*_processes_with(marker), *filter(_alive, workers)]:
            os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multirank
def test_two_nodes_on_loopback_form_one_world_of_four(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lockstep",
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "two-nodes",
                "--nproc-per-node",
                "2",
                str(JOB),
                "ok",
                str(tmp_path),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outputs]
    reports = _reports(tmp_path)
    assert sorted(reports) == [f"rank{r}_attempt0" for r in range(4)]
    assert {r["env"]["WORLD_SIZE"] for r in reports.values()} == {"4"}
    assert sorted(r["env"]["GROUP_RANK"] for r in reports.values()) == ["0", "0", "1", "1"]
    assert {r["sum"] for r in reports.values()} == {10.0}
    assert "hello from rank 3 of 4" in outputs[0][0] + outputs[1][0]


@pytest.mark.multirank
def test_the_same_script_runs_under_plain_python(tmp_path):
    done = subprocess.run(
        [sys.executable, str(JOB), "ok", str(tmp_path)],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hello from rank 0 of 1"
    assert _reports(tmp_path)["rank0_attempt0"]["sum"] == 1.0


@pytest.mark.gpu
def test_auto_starts_one_worker_per_gpu(tmp_path):
    gpus = torch.cuda.device_count()
    done = _lockstep_run("--nproc-per-node", "auto", str(JOB), "ok", str(tmp_path))
    assert done.returncode == 0, done.stderr
    reports = _reports(tmp_path)
    assert len(reports) == gpus
    assert {r["sum"] for r in reports.values()} == {gpus * (gpus + 1) / 2}
