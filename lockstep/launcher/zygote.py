"""Workers forked from a process that has imported torch already: a new one starts in
milliseconds, without the seconds of CPU that ``import torch`` costs.

``lockstep run --survivors`` replaces each warm spare it uses with a new one. Started as a new
interpreter, that spare imports torch (about 5 s of one core here) while the ranks train; on a
machine without a core to spare that slowed the ranks by a third for those seconds after every
kill, most of what a kill cost (docs/checkpoints-and-recovery.md). A :class:`Zygote` is a
``multiprocessing`` fork server that imported torch and lockstep once, at the job's start, with
the workers' environment; each process it forks runs the worker entry point
(:mod:`lockstep.launcher.worker`) as a new interpreter would: the script as ``__main__``, its
own ``sys.argv``, ``sys.path[0]`` and environment, its output through pipes the launcher relays,
and at its end the non-daemon threads joined and ``atexit`` run, then its exit status.

Only for ``python -m lockstep.launcher.worker ...`` commands (what ``lockstep run`` starts
unless ``--no-python``) and where ``fork`` exists; :func:`can_fork` says which.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lockstep.launcher.spawn import WORKER_IMPORTS
from lockstep.launcher.worker import LAUNCHER_PID_ENV

__all__ = ["ForkedProcess", "Zygote", "can_fork", "forked_worker", "worker_args"]

_WORKER = ("-m", "lockstep.launcher.worker")
# What a worker imports before its script: done once in the fork server.
_PRELOAD = [*WORKER_IMPORTS, "lockstep.launcher.worker", __name__]


def can_fork(entrypoint: str, args: Sequence[str]) -> bool:
    """Whether ``[entrypoint, *args]`` is a worker a :class:`Zygote` can fork: this Python
    running ``lockstep.launcher.worker``, on a platform with a fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    rest = _without_unbuffered(args)
    return os.path.realpath(entrypoint) == os.path.realpath(sys.executable) and \
        tuple(rest[:2]) == _WORKER and len(rest) > 2


def worker_args(args: Sequence[str]) -> list[str]:
    """The worker's own arguments (``[-m] TARGET ARGS...``) in a command :func:`can_fork`
    accepts: what :func:`forked_worker` is given."""
    return _without_unbuffered(args)[2:]


def _without_unbuffered(args: Sequence[str]) -> list[str]:
    """``args`` without the interpreter's leading ``-u`` (a forked worker is unbuffered)."""
    return list(args[1:]) if list(args[:1]) == ["-u"] else list(args)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (the fork server inherits it), as it was after."""
    env = dict(env)  # a copy first: ``env`` may be os.environ itself, emptied below
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Zygote:
    """A fork server with torch and lockstep imported, started with ``env`` (the workers'
    environment: thread counts such as ``OMP_NUM_THREADS`` are read when torch loads)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(_PRELOAD)
        with _environment(env):
            multiprocessing.forkserver.ensure_running()  # imports in the background

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
        """Fork a worker running ``python [-u] -m lockstep.launcher.worker ARGS...``.

        Blocks while the fork server is still importing (seconds, once per job)."""
        rest = _without_unbuffered(args)
        out_r, out_w = self._context.Pipe(duplex=False)
        err_r, err_w = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_run_worker, daemon=False,
                                        args=(list(rest[2:]), dict(env), out_w, err_w))
        process.start()
        out_w.close()
        err_w.close()
        return ForkedProcess(process, out_r, err_r)


class _Stream:
    """The read end of a child's stdout or stderr: ``fileno()`` and ``close()``."""

    def __init__(self, connection: multiprocessing.connection.Connection) -> None:
        self._connection = connection

    def fileno(self) -> int:
        return self._connection.fileno()

    def close(self) -> None:
        self._connection.close()


class ForkedProcess:
    """A forked worker with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, process: Any, stdout: Any, stderr: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.stdout = _Stream(stdout)
        self.stderr = _Stream(stderr)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            self._process.terminate()

    def kill(self) -> None:
        if self.poll() is None:
            self._process.kill()


def _text_stream(fd: int) -> io.TextIOWrapper:
    """An unbuffered text stream on ``fd``, as ``python -u`` gives."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, write_through=True, encoding="utf-8",  # type: ignore[arg-type]
                            errors="backslashreplace")


def _run_worker(args: list[str], env: dict[str, str], out: Any, err: Any) -> None:
    """In the forked child: become ``python -u -m lockstep.launcher.worker ARGS...``."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    os.environ.clear()
    os.environ.update(env)
    os._exit(_as_interpreter(args))


def forked_worker(args: list[str]) -> None:
    """torch.distributed.elastic's function entry point for a worker forked from the fork
    server: ``python -u -m lockstep.launcher.worker ARGS...`` in a process that has torch.

    The agent has set the worker's environment and sent fd 1 and 2 to its log files. A failure
    ends the process with the status an interpreter would give (the agent reports it as a
    failed worker, the error file written by the worker's recorder); a script that ends well
    returns, and the agent collects the result.

    A script that ends well *because the agent stopped it* (a SIGTERM handler that saves and
    exits 0, on a restart or a stop of the job) must not wait for the agent to collect its
    result: torch's wrapper waits until every worker's result was read, which a stopping agent
    never does, so it waited the agent's 30 s and was killed. Such a worker hands its result
    over and ends (a process entry point simply exits 0)."""
    with _watch_sigterm() as stopped:
        code = _as_interpreter(args)
    if code:
        os._exit(code)
    if stopped():
        # torch's wrapper puts the result (a pipe write) as soon as this returns, then waits:
        # end the process once that is done.
        threading.Thread(target=_exit_soon, daemon=True, name="lockstep-stopped").start()


_STOPPED_EXIT_S = 1.0  # after the result is handed over: the wrapper puts it at once


def _exit_soon() -> None:
    threading.Event().wait(_STOPPED_EXIT_S)
    os._exit(0)


@contextlib.contextmanager
def _watch_sigterm() -> Iterator[Any]:
    """Yield a function telling whether a SIGTERM reached a Python handler of the script's
    meanwhile: the interpreter writes each caught signal's number to the wakeup fd, whichever
    handler runs. A script that sets its own wakeup fd (asyncio) is not watched."""
    import signal
    import socket

    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread
        reader.close()
        writer.close()
        yield lambda: False
        return
    seen: list[bool] = []

    def stopped() -> bool:
        return bool(seen)

    try:
        yield stopped
    finally:
        current = signal.set_wakeup_fd(previous)
        if current == writer.fileno():  # still ours: read what it was told
            with contextlib.suppress(OSError):
                seen.extend([True] * bytes(reader.recv(4096)).count(signal.SIGTERM))
        reader.close()
        writer.close()


def _as_interpreter(args: list[str]) -> int:
    """Run the worker with ``args`` as a new interpreter would; its exit status."""
    from lockstep.launcher import worker

    sys.stdout, sys.stderr = _text_stream(1), _text_stream(2)
    # multiprocessing gave the fork server /dev/null as sys.stdin; fd 0 is still the launcher's
    # standard input, which a new interpreter reads (``input()``, a piped dataset list).
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the interpreter's stream, never closed
    # Its parent is the fork server, which lives as long as the launcher: the worker's check
    # that the launcher is its parent looks at the fork server.
    os.environ[LAUNCHER_PID_ENV] = str(os.getppid())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        # The fork server loaded torch (and OpenMP read the variable) with its own environment.
        torch.set_num_threads(int(threads))
    _leave_the_fork_server()
    _fresh_random_state()
    sys.argv = [worker.__file__, *args]
    multiprocessing.current_process().name = "MainProcess"  # what scripts that check it expect
    code = 0
    try:
        worker.main(args)
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:  # noqa: BLE001 - what an interpreter does with an uncaught error
        sys.excepthook(*sys.exc_info())
        code = 1
    _shut_threads_down()
    import atexit

    atexit._run_exitfuncs()  # the interpreter's own step, not torch's: no compat module
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _shut_threads_down() -> None:
    """What an interpreter's exit does before ``atexit``: run ``threading``'s own exit hooks,
    mark the main thread finished, join the non-daemon threads. A thread may wait for the main
    thread to end (a checkpoint's writer that publishes once the thread that saved can no longer
    change what it copies): joining them without marking it finished would wait forever.
    ``threading._shutdown`` is the step the interpreter itself runs; where a Python lacks it,
    the threads are joined as they are."""
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown) and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _leave_the_fork_server() -> None:
    """Drop what the fork server gave this child for starting processes of its own.

    ``multiprocessing`` hands each forked child the write end of the pipe that keeps the fork
    server alive, so that the child can use the same server. Held by a worker, it kept the
    server (the worker's parent) alive after the launcher died by SIGKILL, and so the worker:
    its parent-death signal never came. Closed here, the server sees the launcher's end, exits,
    and the workers get their signal; a worker that uses a fork server itself starts its own,
    as a new interpreter would."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if server is None or alive is None:
        return
    with contextlib.suppress(OSError):
        os.close(alive)
    server._forkserver_alive_fd = None  # the standard library's own fork server: no seam
    server._forkserver_address = None
    server._forkserver_pid = None


def _fresh_random_state() -> None:
    """Seed what a new interpreter seeds from the system's entropy, as it would: a fork copies
    the fork server's generators, so every worker (and every restart) would draw the same
    numbers. Python's ``random`` reseeds itself after a fork; torch's CPU generator and numpy's
    global one do not. (CUDA's generators start from a fixed seed in a new interpreter too.)"""
    import torch

    torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _exit_status(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
