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
