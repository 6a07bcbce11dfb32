"""Start worker processes from Python (notebooks, tests) as a launcher would.

Each worker gets torchrun's environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` on
loopback, a free ``MASTER_PORT``...), so the function it runs calls
:func:`lockstep.init_distributed` exactly as a script under ``lockstep run`` does. A worker's
exception comes back to the caller with its traceback and rank; once one worker fails, the
others are stopped instead of being left to wait in a collective.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from lockstep.env import loopback_gloo
from lockstep.launcher.payload import interactive_main, pack, unpack

logger = logging.getLogger(__name__)

# What a forked worker finds imported: torch, and DDP's imports (torch.compile's Dynamo, 1.7 s
# of a new interpreter's first DDP), done once in the fork server.
WORKER_IMPORTS = ["torch", "torch.distributed", "lockstep", "lockstep.ddp.wrapper"]

__all__ = ["WORKER_IMPORTS", "WorkerError", "find_free_port", "spawn"]

# How long survivors get to finish on their own once a peer failed, before being killed.
_GRACE_AFTER_FAILURE_S = 2.0


class WorkerError(RuntimeError):
    """A spawned worker raised, died or ran out of time; ``rank`` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _worker(payload: bytes, rank: int, env: dict, results: Any) -> None:
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        import torch

        # A forked worker imported torch before seeing the variable: apply it explicitly.
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        # Unpacked here, not by multiprocessing, so that a function this interpreter cannot
        # find comes back to the caller as this rank's error, not as a bare exit code.
        fn, args = unpack(payload)
        value = fn(rank, *args)
        # Plain pickle copies tensor data into the message; multiprocessing's own pickler would
        # send a handle to this worker's shared memory, which dies with the worker.
        results.put((rank, True, pickle.dumps(value), _lingering()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}",
                     _lingering()))
    finally:
        from lockstep.distributed import shutdown_distributed

        shutdown_distributed()  # joins gloo's threads before this interpreter finalizes


def _lingering() -> list[str]:
    """The threads that would keep this process from exiting (not daemons): a checkpoint
    still being written, say. The caller lets such a rank exit by itself instead of killing it."""
    main = threading.main_thread()
    return [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _worker_env(rank: int, nprocs: int, port: int, threads: int | None) -> dict[str, str]:
    # The caller's whole environment, as a fresh interpreter would inherit it: forkserver
    # workers otherwise see the server's environment from when it started.
    env = dict(os.environ)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(loopback_gloo(env))  # a one-machine world talks over loopback only
    return env


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = 300.0,
    start_method: str | None = None,
    threads_per_worker: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes that form one world on loopback.

    Workers are new interpreters: ``fn`` is a function defined at the top level of a module, of
    a script (then call ``spawn`` under ``if __name__ == "__main__":``, since every worker
    imports the script), or of a notebook cell or other interactive session (then it is sent
    by value, with the functions of the session it calls).

    Args:
        fn: the worker function; call :func:`lockstep.init_distributed` inside it.
        nprocs: number of workers (the world size).
        args: extra positional arguments, pickled to every worker.
        timeout: seconds before every worker is killed and :class:`WorkerError` raised
            (``None`` waits forever).
        start_method: ``"spawn"`` (the default, safe everywhere) or ``"forkserver"`` (workers
            fork from a server that imported torch once: much faster to start many worlds, as
            a test suite does). ``None`` reads ``LOCKSTEP_START_METHOD``, else ``"spawn"``.
        threads_per_worker: ``OMP_NUM_THREADS`` for each worker (``None`` leaves it).

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        WorkerError: a worker raised (its traceback is in the message), died, or timed out.
        TypeError: ``fn`` or ``args`` cannot reach the workers (e.g. a class defined in a
            notebook), said before any worker starts.
        RuntimeError: called at the top level of a script without the ``__main__`` guard.

    Example::

        def work(rank):
            info = lockstep.init_distributed()
            return info.rank

        assert lockstep.spawn(work, 2) == [0, 1]
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an int of at least 1, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"lockstep.spawn needs a function to run, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args= must be a tuple of the function's arguments after the rank, e.g. "
                        f"args=({args!r},), got {type(args).__name__}")
    _refuse_unguarded_call(sys._getframe(1))
    payload = pack(fn, tuple(args))
    method = start_method or os.environ.get("LOCKSTEP_START_METHOD", "spawn")
    ctx: Any = mp.get_context(method)
    if method == "forkserver":
        # The server imports torch once; each worker is then a cheap fork of it. The server
        # never runs torch ops, so forking it is safe (no OpenMP pool to inherit).
        ctx.set_forkserver_preload(WORKER_IMPORTS)
    results = ctx.Queue()
    port = find_free_port()
    procs = []
    for rank in range(nprocs):
        env = _worker_env(rank, nprocs, port, threads_per_worker)
        # Not daemons: a rank may start processes of its own (DataLoader workers), as under
        # torch.multiprocessing.spawn; _stop ends every rank, whatever happens here.
        proc = ctx.Process(target=_worker, args=(payload, rank, env, results), daemon=False)
        proc.start()
        procs.append(proc)
    deadline = None if timeout is None else time.monotonic() + timeout
    lingering: dict[int, list[str]] = {}
    finished = False
    try:
        values = _collect(procs, results, timeout, lingering)
        finished = True
        return values
    finally:
        _stop(procs, lingering if finished else {}, deadline)
        results.close()


def _stop(procs: list, lingering: dict[int, list[str]], deadline: float | None) -> None:
    """End the workers: a rank that returned while threads of its own still ran (a checkpoint
    being written) exits by itself, within the spawn's timeout; the others are killed at once,
    as they have nothing left to do that matters (interpreter teardown costs ~0.5 s a rank)."""
    for rank, proc in enumerate(procs):
        if lingering.get(rank):
            proc.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("lockstep.spawn: rank %d still ran %s when the timeout expired: killed",
                               rank, ", ".join(lingering[rank]))
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


def _refuse_unguarded_call(caller: Any) -> None:
    """Refuse ``spawn`` at a script's top level outside ``if __name__ == "__main__":``.

    Every worker imports the script to find the function; unguarded, the import would start
    workers of its own, and each worker would die before reporting anything.
    """
    if caller.f_code.co_name != "<module>" or caller.f_globals.get("__name__") != "__main__":
        return
    path = caller.f_globals.get("__file__")
    if not path or interactive_main():
        return
    try:
        with open(path) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return
    line = caller.f_lineno
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or "__main__" not in ast.unparse(node.test):
            continue
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise RuntimeError(
        f"lockstep.spawn is called at the top level of {path} (line {line}) without "
        '`if __name__ == "__main__":`. Every worker imports this script to find the function '
        "and would start workers of its own: put the call (and only it) under that guard."
    )


def _dead_without_report(procs: list, reported: set[int]) -> WorkerError | None:
    for rank, proc in enumerate(procs):
        if rank not in reported and proc.exitcode is not None:
            code = proc.exitcode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            return WorkerError(rank, f"rank {rank} died with {how} before returning")
    return None


def _collect(procs: list, results: Any, timeout: float | None,
             lingering: dict[int, list[str]]) -> list[Any]:
    """Wait for every rank's result (and note in ``lingering`` the threads each rank still ran
    when it reported); on failure, name the root cause.

    A rank that died without reporting (a signal, ``os._exit``) is the root cause over ranks
    that raised afterwards, since their errors are usually the broken connection to it.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: list[WorkerError] = []
    reported: set[int] = set()
    failed_at: float | None = None
    while len(reported) < len(procs):
        try:
            rank, ok, value, lingering[rank] = results.get(timeout=0.1)
            reported.add(rank)
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures.append(WorkerError(rank, f"rank {rank} raised {value}"))
                failed_at = failed_at or time.monotonic()
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        if failed_at is None:
            time.sleep(0.05)  # a result may still be in the pipe of a process that just exited
            if results.empty() and _dead_without_report(procs, reported) is not None:
                failed_at = now
        if failed_at is not None and now - failed_at > _GRACE_AFTER_FAILURE_S:
            break
        if deadline is not None and now > deadline:
            missing = [r for r in range(len(procs)) if r not in reported]
            raise WorkerError(
                missing[0], f"ranks {missing} did not finish within {timeout:.0f}s; all were killed"
            )
    dead = _dead_without_report(procs, reported)
    if dead is not None:
        raise dead
    if failures:
        raise failures[0]
    return [values[r] for r in range(len(procs))]
