"""The launcher's zygote: a worker forked from a process that imported torch behaves as
``python -u -m lockstep.launcher.worker script.py`` would: ``__main__``, argv, environment,
output, exit status, ``atexit`` and non-daemon threads at its end, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lockstep.launcher.zygote import Zygote, can_fork

SCRIPT = """
import atexit, os, sys, threading, time
import multiprocessing
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended", flush=True))).start()
print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(__file__))
print("env", os.environ.get("ZYGOTE_TEST"), "process", multiprocessing.current_process().name)
print("stdin fd", sys.stdin.fileno())  # the launcher's standard input, as in a new interpreter
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("the script's own error")
if sys.argv[1] == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _read(stream) -> str:
    chunks = []
    while chunk := os.read(stream.fileno(), 65536):
        chunks.append(chunk)
    stream.close()
    return b"".join(chunks).decode()


@pytest.fixture(scope="module")
def zygote():
    return Zygote(dict(os.environ))


def _worker(tmp_path, *args: str) -> list[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return ["-u", "-m", "lockstep.launcher.worker", str(script), *args]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_forked_worker_runs_the_script_as_python_would(zygote, tmp_path) -> None:
    proc = zygote.start(_worker(tmp_path, "3", "-u"), {**os.environ, "ZYGOTE_TEST": "given"})
    assert proc.wait(60) == 3
    out, err = _read(proc.stdout), _read(proc.stderr)
    assert "name __main__ argv ['3', '-u'] path0 True" in out
    assert "env given process MainProcess" in out
    assert "stdin fd 0" in out  # /dev/null on another descriptor until 2026-11-29
    # The interpreter's exit: the non-daemon thread is joined before atexit runs.
    assert out.index("thread ended") < out.index("atexit ran"), out
    assert err.strip() == "to stderr"


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_forked_workers_error_and_signals_are_its_exit_status(zygote, tmp_path) -> None:
    failed = zygote.start(_worker(tmp_path, "raise"), dict(os.environ))
    assert failed.wait(60) == 1
    assert "ValueError: the script's own error" in _read(failed.stderr)
    _read(failed.stdout)
    for stop, code in ((lambda p: p.terminate(), -signal.SIGTERM), (lambda p: p.kill(), -9)):
        proc = zygote.start(_worker(tmp_path, "sleep"), dict(os.environ))
        deadline = time.monotonic() + 60
        seen = b""
        while b"sleeping" not in seen and time.monotonic() < deadline:
            seen += os.read(proc.stdout.fileno(), 65536)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        stop(proc)
        assert proc.wait(30) == code
        proc.stdout.close()
        proc.stderr.close()


def test_only_lockstep_workers_of_this_python_are_forked() -> None:
    worker = ["-u", "-m", "lockstep.launcher.worker", "train.py", "-u", "1"]
    assert can_fork(sys.executable, worker)
    assert can_fork(sys.executable, ["-u", "-m", "lockstep.launcher.worker", "-m", "pkg.train"])
    assert not can_fork("/bin/sh", worker)  # --no-python: the user's own program
    assert not can_fork(sys.executable, ["-u", "train.py"])
    assert not can_fork(sys.executable, ["-u", "-m", "lockstep.launcher.worker"])  # no script


RESTARTED = """
import atexit, os, sys, threading
with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent:
    forked = b"forkserver" in parent.read()  # a new interpreter's parent is the launcher
import numpy
import torch
import torch.distributed as dist

print(f"draws {torch.rand(1).item()} {numpy.random.rand()}", flush=True)
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
atexit.register(lambda: print(f"atexit ran {attempt}", flush=True))
print(f"attempt {attempt} rank {rank} forked {forked} name {__name__} argv {sys.argv[1:]} "
      f"threads {torch.get_num_threads()}", flush=True)
threading.Thread(target=lambda: print(f"thread ended {attempt}", flush=True)).start()
print(f"user env {attempt} {os.environ.get('LOCKSTEP_TEST_USER_FLAG')} {'PATH' in os.environ}", flush=True)
print(f"signals {attempt} {os.environ.get('TORCHELASTIC_SIGNALS_TO_HANDLE')}", flush=True)
# A thread that waits for the main thread to end (as a checkpoint's writer may) ends too.
main = threading.main_thread()
threading.Thread(target=lambda: (main.join(), print(f"after main {attempt}", flush=True))).start()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
dist.destroy_process_group()
if attempt == "0" and rank == 1:
    raise ValueError("the first attempt fails")
if sys.argv[1] == "always" and rank == 1:
    sys.exit(7)
"""


def _launch(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """Two workers, one restart: rank 1 raises in the first attempt and exits 7 in the second."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_TEST_USER_FLAG": "kept"}
    return subprocess.run([sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2",
                           "--max-restarts", "1", *flags, str(script), "always"],
                          check=False, capture_output=True, text=True, timeout=150,
                          env=env)


def _last_failure(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 7, run.stdout + run.stderr
    return run.stderr[run.stderr.index("lockstep run:"):]


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_restarted_workers_are_forked_with_torch_imported(tmp_path) -> None:
    run = _launch(tmp_path)
    for attempt in "01":
        for rank in "01":
            assert (f"[rank{rank}]: attempt {attempt} rank {rank} forked True name __main__ "
                    f"argv ['always'] threads 1") in run.stdout, run.stdout
        # The interpreter's exit: non-daemon threads joined, atexit run (each rank), also
        # after ``sys.exit(7)``.
        assert run.stdout.count(f"thread ended {attempt}") == 2, run.stdout
        # The user's environment reaches forked workers (it was emptied before 2026-11-28).
        assert run.stdout.count(f"user env {attempt} kept True") == 2, run.stdout
        # torch's launcher sets this for its workers; forked ones lacked it until 2026-11-29.
        assert run.stdout.count(f"signals {attempt} SIGTERM,SIGINT,SIGHUP,SIGQUIT") == 2, \
            run.stdout
        assert run.stdout.count(f"after main {attempt}") == 2, run.stdout
    assert run.stdout.count("atexit ran 1") == 2, run.stdout
    # Each worker's generators are seeded as a new interpreter's are, not copied from the server.
    draws = [line.split("draws ")[1] for line in run.stdout.splitlines() if "draws " in line]
    assert len(draws) == 4 and len({d.split()[0] for d in draws}) == 4, draws
    assert len({d.split()[1] for d in draws}) == 4, draws
    assert "ValueError: the first attempt fails" in run.stderr
    # The agent's line for the failure, without the launcher's own traceback.
    assert "exitcode: 1" in run.stderr and "Traceback (most recent call last):\n  File" \
        not in run.stderr.split("ValueError")[-1], run.stderr
    # The last attempt's failure is reported as a process's would be.
    report = _last_failure(run)
    assert "Root cause: rank 1" in report and "exit code 7" in report, report


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_no_fork_starts_new_interpreters_reported_the_same_way(tmp_path) -> None:
    fresh = _launch(tmp_path, "--no-fork")
    assert "forked False" in fresh.stdout and "forked True" not in fresh.stdout
    report = _last_failure(fresh)
    assert "Root cause: rank 1" in report and "exit code 7" in report, report


STOPPED = """
import os, signal, sys, time
import torch.distributed as dist
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # save and exit on SIGTERM
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
if attempt == "0":
    if dist.get_rank() == 1:
        time.sleep(1)
        raise ValueError("rank 1 fails")
    time.sleep(60)  # stopped by the agent: its handler exits 0
dist.destroy_process_group()
print(f"done {attempt}", flush=True)
"""


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_a_forked_worker_that_exits_0_on_sigterm_ends_at_the_restart(tmp_path) -> None:
    """A worker whose SIGTERM handler exits 0 (save and exit) is stopped by the agent at the
    restart: it waited for the agent to collect its result, which a stopping agent never
    does, until the agent killed it 30 s later."""
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    run = subprocess.run([sys.executable, "-m", "lockstep", "run", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(script)], check=False, capture_output=True,
                         text=True, timeout=140, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("done 1") == 2, run.stdout
    assert "forcefully exiting" not in run.stderr, run.stderr
