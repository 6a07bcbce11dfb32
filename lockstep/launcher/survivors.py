"""``lockstep run --survivors``: one machine's workers, where a death stops nobody else.

torch's elastic agent restarts every worker after any failure. Here the launcher hosts the
job's store itself, starts one process per rank, and when one dies it marks the dead process
in the store (so the survivors' roll call ends at once, see :mod:`lockstep.resilience`) and
starts a replacement for that rank with ``LOCKSTEP_SURVIVOR_JOIN=1``, up to ``--max-restarts``
times. The survivors keep training in a smaller world; the replacement joins at a step
boundary. The job ends when every worker has exited 0; it fails (the others stopped) when a
worker fails with no restart left or nobody is left alive to take a replacement in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import IO, TextIO

import torch.distributed as dist

from lockstep.diagnose.progress import INTERVAL_ENV_VAR
from lockstep.launcher.launch_plan import LaunchPlan
from lockstep.launcher.output import PrefixWriter
from lockstep.launcher.spawn import find_free_port
from lockstep.launcher.worker import LAUNCHER_PID_ENV
from lockstep.resilience.roster import job_store
from lockstep.resilience.survivors import JOIN_ENV, SURVIVORS_ENV

__all__ = ["supervise"]

_STOP_GRACE_S = 5.0


class _Relay:
    """Copy each worker's stdout and stderr to ours, every line prefixed with its rank."""

    def __init__(self) -> None:
        self._writer = PrefixWriter()
        self._lock = threading.Lock()

    def follow(self, stream: IO[bytes] | None, source: str, prefix: str,
               dst: TextIO | None) -> None:
        """Copy ``stream`` to ``dst`` in a thread (``dst`` None: read and drop it)."""
        if stream is None:
            return

        def pump() -> None:
            while chunk := os.read(stream.fileno(), 65536):
                if dst is not None:
                    with self._lock:
                        self._writer.write(source, prefix, chunk.decode(errors="replace"), dst)
            stream.close()

        threading.Thread(target=pump, daemon=True).start()


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise _Interrupted(signum)


def supervise(plan: LaunchPlan) -> int:
    """Run ``plan``'s workers on this machine with survivors; returns the exit status."""
    port = find_free_port()
    store = job_store(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60)))
    world = plan.nproc_per_node
    base = {**os.environ, **plan.worker_env, LAUNCHER_PID_ENV: str(os.getpid()),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": plan.run_id, SURVIVORS_ENV: "1",
            # This launcher hosts the store and outlives the workers (no waiting for peers'
            # exit records), and names the dead itself: no progress records, so a failed
            # collective raises at once instead of watching heartbeats for seconds.
            "TORCHELASTIC_USE_AGENT_STORE": "true", INTERVAL_ENV_VAR: "off"}
    relay = _Relay()

    def start(rank: int, replacement: bool) -> subprocess.Popen:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)}
        if replacement:
            env[JOIN_ENV] = "1"
        proc = subprocess.Popen([plan.entrypoint, *plan.args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        shown = plan.local_ranks_filter is None or rank in plan.local_ranks_filter
        for stream, dst, name in ((proc.stdout, sys.stdout, "out"), (proc.stderr, sys.stderr, "err")):
            relay.follow(stream, f"{rank}-{proc.pid}-{name}", f"[rank{rank}]: ",
                         dst if shown else None)
        return proc

    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    procs = {rank: start(rank, False) for rank in range(world)}
    replacements: set[int] = set()  # pids of replacements not yet seen admitted

    def training(rank: int, proc: subprocess.Popen) -> bool:
        """Is this process in the world (not a replacement still waiting to be admitted)?"""
        if proc.pid in replacements and store.check([f"admitted/{rank}/{proc.pid}"]):
            replacements.discard(proc.pid)
        return proc.pid not in replacements

    restarts, finished = 0, set()
    try:
        while procs:
            for rank, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[rank]
                if code == 0:
                    finished.add(rank)
                    continue
                store.set(f"dead/{proc.pid}", str(code))
                print(f"lockstep run: rank {rank} (pid {proc.pid}) {_describe(code)}",
                      file=sys.stderr, flush=True)
                alive = any(training(r, p) for r, p in procs.items())
                if restarts < plan.max_restarts and alive and not finished:
                    restarts += 1
                    procs[rank] = start(rank, True)
                    replacements.add(procs[rank].pid)
                    print(f"lockstep run: the other ranks go on; a replacement for rank {rank} "
                          f"joins them (restart {restarts} of {plan.max_restarts})",
                          file=sys.stderr, flush=True)
                    continue
                why = ("no restart left (--max-restarts "
                       f"{plan.max_restarts})" if restarts >= plan.max_restarts else
                       "no worker left training to take a replacement in" if not alive else
                       "other ranks had already finished")
                print(f"lockstep run: rank {rank} failed and the job stops: {why}.",
                      file=sys.stderr, flush=True)
                _stop(procs)
                return _exit_code(code)
            time.sleep(plan.monitor_interval)
    except _Interrupted as stop:
        _stop(procs)
        print(f"lockstep run: stopped by {signal.Signals(stop.signum).name}; every worker was "
              "stopped.", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    """SIGTERM every worker, SIGKILL those still running after a grace period."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
