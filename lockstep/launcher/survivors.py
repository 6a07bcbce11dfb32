"""``lockstep run --survivors``: workers where a death stops nobody else.

torch's elastic agent restarts every worker after any failure. Here the launcher hosts the
job's store itself, starts one process per rank, and when one dies it marks the dead process
in the store (so the survivors' roll call ends at once, see :mod:`lockstep.resilience`) and
gives that rank a replacement, up to ``--max-restarts`` times: a warm spare when one waits
(``--spares``, default 1: a process that has run the script up to ``lockstep.Survivors()``,
imports done, and waits there for a rank), else a new process with
``LOCKSTEP_SURVIVOR_JOIN=1``; a used spare is replaced by a new one. Spares are forked from a
zygote that imported torch once (:mod:`lockstep.launcher.zygote`), so a new spare does not
take a core from the training ranks for the seconds of ``import torch``. The survivors keep training in a smaller world; the replacement joins at a step
boundary. The job ends when every worker has exited 0; it fails (the others stopped) when a
worker fails with no restart left or nobody is left alive to take a replacement in.

On several machines (``--nnodes N`` with ``--node-rank``), machine 0's launcher hosts the store
at the rendezvous endpoint and the others connect to it; each launcher starts and replaces its
own machine's ranks, and they watch each other's heartbeats (:mod:`lockstep.launcher.machines`):
the ranks of a machine that stops answering for ``--node-timeout`` seconds are marked dead and
the others go on; a launcher started again for that machine brings replacements.

A worker frozen (SIGSTOP, stuck in the kernel) neither exits nor closes its connections; the
workers' heartbeats (:mod:`lockstep.resilience.heartbeat`) tell it from a busy one: a worker or
spare silent for ``LOCKSTEP_SURVIVORS_HEARTBEAT_TIMEOUT`` seconds is killed with SIGKILL, then
counted lost as any worker that died.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, Protocol, TextIO

import torch.distributed as dist

from lockstep.diagnose.progress import INTERVAL_ENV_VAR
from lockstep.launcher.launch_plan import LaunchPlan, parse_endpoint
from lockstep.launcher.machines import Machines
from lockstep.launcher.output import PrefixWriter
from lockstep.launcher.spawn import find_free_port
from lockstep.launcher.worker import LAUNCHER_PID_ENV
from lockstep.launcher.zygote import ForkedProcess, Zygote, can_fork
from lockstep.resilience.heartbeat import (
    TIMEOUT_ENV,
    Silence,
    beat_interval,
    beat_key,
    describe_state,
    heartbeat_timeout,
)
from lockstep.resilience.roster import dead_key, job_store, spare_key
from lockstep.resilience.survivors import JOIN_ENV, SPARE_ENV, SURVIVORS_ENV

__all__ = ["supervise"]

_STOP_GRACE_S = 5.0
_STORE_WAIT_S = 600.0  # how long a machine's launcher waits for machine 0's store
_SPARE_KILLS = 3  # spares killed by a signal that are replaced before spares are given up

Worker = subprocess.Popen | ForkedProcess  # a process started for a rank, or a spare


class _Readable(Protocol):
    """A pipe's read end: a forked worker's output (``subprocess`` gives ``IO[bytes]``)."""

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class _Relay:
    """Copy each worker's stdout and stderr to ours, every line prefixed with its rank."""

    def __init__(self) -> None:
        self._writer = PrefixWriter()
        self._lock = threading.Lock()

    def follow(self, stream: IO[bytes] | _Readable | None, source: str, prefix: Callable[[], str],
               dst: TextIO | None) -> None:
        """Copy ``stream`` to ``dst`` in a thread (``dst`` None: read and drop it)."""
        if stream is None:
            return

        def pump() -> None:
            while chunk := os.read(stream.fileno(), 65536):
                if dst is not None:
                    with self._lock:
                        self._writer.write(source, prefix(), chunk.decode(errors="replace"), dst)
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


_WAITING_LINE_S = 10.0  # how often a launcher says which machines have not started yet


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise _Interrupted(signum)


def supervise(plan: LaunchPlan) -> int:
    """Run ``plan``'s workers on this machine with survivors; returns the exit status."""
    try:
        heartbeat_timeout({**os.environ, **plan.worker_env})
    except ValueError as err:
        print(f"lockstep run: {err}", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        job = _Job(plan)
    except dist.DistError as err:  # machine 0's launcher never came up, or is unreachable
        if plan.node_rank == 0 and plan.max_nodes > 1 and "EADDRINUSE" in str(err):
            print(f"lockstep run: machine 0 cannot host the job's store at {plan.rdzv_endpoint}: "
                  "the port is taken. Another launcher of this job already hosts it: with "
                  "--survivors every machine gives its own --node-rank (0 on the first, "
                  f"{'1' if plan.max_nodes == 2 else f'1 to {plan.max_nodes - 1}'} on the "
                  "others; none was given here, or 0 twice); or "
                  "another program holds the port: choose another", file=sys.stderr)
        else:
            print(f"lockstep run: could not reach the job's store at {plan.rdzv_endpoint} "
                  f"({err}): start machine 0's launcher there (it hosts the store), or check "
                  "--rdzv-endpoint", file=sys.stderr)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        return 1
    try:
        return job.run()
    except dist.DistError as err:  # the job's store (machine 0's launcher) is gone
        job.stop_all()
        print(f"lockstep run: lost the job's store at {plan.rdzv_endpoint} ({err}); machine 0, "
              "whose launcher hosts it, is gone or unreachable: every worker here was stopped. "
              "Restart the job (a Checkpointer's newest checkpoint is where it resumes).",
              file=sys.stderr)
        return 1
    except _Interrupted as stop:
        job.stop_all()
        print(f"lockstep run: stopped by {signal.Signals(stop.signum).name}; every worker was "
              "stopped.", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Job:
    """The workers of one ``--survivors`` job, its warm spares, and what happens at a death."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        nnodes, node = plan.max_nodes, plan.node_rank
        if nnodes == 1:
            host, port = "127.0.0.1", find_free_port()
            master = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        else:  # machine 0 hosts the job's store at the endpoint; the others connect to it
            host, port = parse_endpoint(plan.rdzv_endpoint)
            master = dist.TCPStore(host, port, is_master=node == 0, wait_for_workers=False,
                                   timeout=timedelta(seconds=_STORE_WAIT_S))
        self.store = job_store(master)
        self.machines = (Machines(self.store, node, nnodes, plan.node_timeout)
                         if nnodes > 1 else None)
        self.first = node * plan.nproc_per_node  # this machine's first rank
        world = nnodes * plan.nproc_per_node
        self.base = {
            **os.environ, **plan.worker_env, LAUNCHER_PID_ENV: str(os.getpid()),
            "MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(plan.nproc_per_node), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": plan.role,
            "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nnodes),
            "TORCHELASTIC_RUN_ID": plan.run_id, SURVIVORS_ENV: "1",
            # As torchrun's workers have them; the count is the replacements this launcher
            # made so far (a replacement sees its own counted).
            "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts), "TORCHELASTIC_RESTART_COUNT": "0",
            # This launcher hosts the store and outlives the workers (no waiting for peers'
            # exit records), and names the dead itself: no progress records, so a failed
            # collective raises at once instead of watching heartbeats for seconds.
            "TORCHELASTIC_USE_AGENT_STORE": "true", INTERVAL_ENV_VAR: "off",
        }
        self.relay = _Relay()
        timeout = heartbeat_timeout(self.base)  # checked by supervise()
        self.silence = (Silence(lambda pid: int(self.store.add(beat_key(node, pid), 0)), timeout)
                        if timeout is not None else None)
        self._next_beat_look = 0.0
        self.frozen: dict[int, str] = {}  # pid -> why this launcher killed it (no heartbeat)
        self.names: dict[int, str] = {}  # pid -> its output prefix
        self.procs: dict[int, Worker] = {}  # rank -> its process
        self.spares: list[Worker] = []  # started, imported, waiting for a rank
        self.waiting: set[int] = set()  # pids of replacements not yet seen admitted
        self.restarts = 0
        self._next_waiting_line = 0.0  # when to say again which machines have not started
        self.spares_failed = False
        self.spare_kills = 0  # spares killed by a signal, each replaced (up to _SPARE_KILLS)
        # Spares are forked from a process that imported torch once, at the start.
        self.zygote: Zygote | None = None
        if self.machines is not None and self.machines.replacement:
            gone = self.machines.retire_predecessor()
            print(f"lockstep run: this launcher replaces machine {node} (ranks "
                  f"{sorted(gone) or 'unknown'} of the one before are counted gone); its "
                  "workers join the others at a step boundary", file=sys.stderr, flush=True)
        if plan.spares and plan.fork_workers and can_fork(plan.entrypoint, plan.args):
            try:
                self.zygote = Zygote({**self.base, SPARE_ENV: "1", JOIN_ENV: "1"})
            except (OSError, RuntimeError, ValueError) as err:  # spares start as before
                print(f"lockstep run: spares start as new interpreters ({err})",
                      file=sys.stderr, flush=True)

    def start(self, rank: int | None, replacement: bool,
              forked: bool = False) -> Worker:
        """A worker for ``rank``, or a spare (``rank`` None) that waits for one; ``forked``:
        from the zygote (a spare)."""
        env = dict(self.base)
        if rank is None:
            env[SPARE_ENV] = "1"
        else:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank - self.first), ROLE_RANK=str(rank),
                       TORCHELASTIC_RESTART_COUNT=str(self.restarts))
        if replacement or rank is None:
            env[JOIN_ENV] = "1"
        proc: Worker | None
        try:
            proc = self.zygote.start(self.plan.args, env) if forked and self.zygote else None
        except (OSError, RuntimeError, EOFError) as err:  # the zygote is gone: as before
            print(f"lockstep run: forking a spare failed ({err}); starting it as a new "
                  "interpreter", file=sys.stderr, flush=True)
            self.zygote = proc = None
        if proc is None:
            proc = subprocess.Popen([self.plan.entrypoint, *self.plan.args], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.names[proc.pid] = f"[rank{rank}]: " if rank is not None else "[spare]: "
        shown = self.plan.local_ranks_filter
        for stream, dst, name in ((proc.stdout, sys.stdout, "out"), (proc.stderr, sys.stderr, "err")):
            visible = shown is None or rank is None or rank - self.first in shown
            self.relay.follow(stream, f"{proc.pid}-{name}",
                              functools.partial(self.names.__getitem__, proc.pid),
                              dst if visible else None)
        return proc

    def training(self, rank: int, proc: Worker) -> bool:
        """Is this process in the world (not a replacement still waiting to be admitted)?"""
        if proc.pid in self.waiting and self.store.check([f"admitted/{rank}/{proc.pid}"]):
            self.waiting.discard(proc.pid)
        return proc.pid not in self.waiting

    def replace(self, rank: int) -> str:
        """Give ``rank`` a replacement: a warm spare when one waits, else a new process."""
        self.restarts += 1
        if self.spares:
            spare = self.spares.pop(0)
            self.store.set(spare_key(self.plan.node_rank, spare.pid),
                           f"{rank},{rank - self.first},{self.restarts}")
            self.names[spare.pid] = f"[rank{rank}]: "
            self.procs[rank] = spare
            how = f"a warm spare (pid {spare.pid})"
            if not self.spares_failed:
                self.spares.append(self.start(None, True, forked=True))
        else:
            self.procs[rank] = self.start(rank, True)
            how = "a new process"
        self.waiting.add(self.procs[rank].pid)
        return how

    def others_alive(self) -> bool:
        """Is a worker of this job training, here or on another machine still there?"""
        here = any(self.training(r, p) for r, p in self.procs.items())
        return here or (self.machines is not None and self.machines.others_alive())

    def watch_machines(self) -> None:
        """Beat, and count lost the machines that stopped beating (several machines)."""
        if self.machines is None:
            return
        self.machines.beat({rank: proc.pid for rank, proc in self.procs.items()})
        lost = self.machines.check()
        missing = self.machines.never_seen()
        now = time.monotonic()
        if missing and now >= self._next_waiting_line:
            if self._next_waiting_line:  # not at the first look: they had a few seconds
                print(f"lockstep run: waiting for machine(s) {missing} of {self.plan.max_nodes} "
                      f"to start (job store at {self.plan.rdzv_endpoint}): each machine runs "
                      "`lockstep run --survivors` with the same --rdzv-endpoint and --nnodes "
                      f"and its own --node-rank (0 to {self.plan.max_nodes - 1})",
                      file=sys.stderr, flush=True)
            self._next_waiting_line = now + _WAITING_LINE_S
        for node, ranks in lost.items():
            print(f"lockstep run: machine {node} has not been heard from for "
                  f"{self.plan.node_timeout:g} s: counted lost with its ranks "
                  f"{sorted(ranks) or '(none known)'}; the others go on. Start its launcher "
                  f"again (--node-rank {node}) to bring replacements.", file=sys.stderr, flush=True)

    def watch_beats(self) -> None:
        """Kill (SIGKILL) the workers and spares whose heartbeat stood still for the timeout:
        frozen, they would hold their peers in a collective for good; dead, they are replaced."""
        now = time.monotonic()
        if self.silence is None or now < self._next_beat_look:
            return
        self._next_beat_look = now + beat_interval(self.silence.timeout)
        workers: dict[int, tuple[str, Worker]] = {
            **{p.pid: ("a spare worker", p) for p in self.spares},
            **{p.pid: (f"rank {r}", p) for r, p in self.procs.items()}}
        for pid, quiet in self.silence.silent(workers).items():
            who, proc = workers[pid]
            if pid in self.frozen or proc.poll() is not None:
                continue
            state = describe_state(pid)
            self.frozen[pid] = f"frozen: no heartbeat for {quiet:.0f} s"
            print(f"lockstep run: {who} (pid {pid}) has sent no heartbeat for {quiet:.0f} s "
                  f"({TIMEOUT_ENV}={self.silence.timeout:g})"
                  f"{f', and is {state}' if state else ''}: counted frozen; it is killed with "
                  "SIGKILL and counted lost as if it had died", file=sys.stderr, flush=True)
            proc.kill()

    def _how_it_ended(self, proc: Worker, code: int) -> str:
        frozen = self.frozen.pop(proc.pid, None)
        return _describe(code) + (f" (by this launcher: {frozen})" if frozen else "")

    def run(self) -> int:
        plan = self.plan
        joining = self.machines is not None and self.machines.replacement
        ranks = range(self.first, self.first + plan.nproc_per_node)
        self.procs = {rank: self.start(rank, joining) for rank in ranks}
        if joining:
            self.waiting.update(p.pid for p in self.procs.values())
        self.spares = [self.start(None, True, forked=True) for _ in range(plan.spares)]
        finished: set[int] = set()
        while self.procs:
            self.watch_machines()
            self.watch_beats()
            for spare in list(self.spares):
                ended = spare.poll()
                if ended is None:
                    continue
                self.spares.remove(spare)
                if ended < 0 and self.spare_kills < _SPARE_KILLS and not self.spares_failed:
                    # Killed (the OOM killer, a user's kill): the script is not at fault.
                    self.spare_kills += 1
                    print(f"lockstep run: a spare worker (pid {spare.pid}) "
                          f"{self._how_it_ended(spare, ended)} before it was needed; another is "
                          "started", file=sys.stderr, flush=True)
                    self.spares.append(self.start(None, True, forked=True))
                elif ended != 0:  # a spare that cannot start (or killed again and again)
                    self.spares_failed = True
                    print(f"lockstep run: a spare worker (pid {spare.pid}) "
                          f"{self._how_it_ended(spare, ended)} before it was needed; no more "
                          "spares",
                          file=sys.stderr, flush=True)
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[rank]
                if code == 0:
                    finished.add(rank)
                    continue
                frozen = self.frozen.get(proc.pid)
                how_ended = self._how_it_ended(proc, code)
                # What the survivors' messages quote ("a launcher marked it dead (...)").
                self.store.set(dead_key(rank, proc.pid), f"{code}, {frozen}" if frozen else str(code))
                print(f"lockstep run: rank {rank} (pid {proc.pid}) {how_ended}",
                      file=sys.stderr, flush=True)
                alive = self.others_alive()
                if self.restarts < plan.max_restarts and alive and not finished:
                    how = self.replace(rank)
                    print(f"lockstep run: the other ranks go on; {how} takes rank {rank} "
                          f"(restart {self.restarts} of {plan.max_restarts})",
                          file=sys.stderr, flush=True)
                    continue
                why = ("no restart left (--max-restarts "
                       f"{plan.max_restarts})" if self.restarts >= plan.max_restarts else
                       "no worker left training to take a replacement in" if not alive else
                       "other ranks had already finished")
                print(f"lockstep run: rank {rank} failed and the job stops: {why}.",
                      file=sys.stderr, flush=True)
                self.stop_all()
                return _exit_code(code)
            if finished and self.procs and not self.others_alive():
                # The training ranks are done; replacements still waiting to be admitted
                # would wait for a step that never comes (team.finish() says it, too).
                self.store.set("done", "1")
            time.sleep(plan.monitor_interval)
        if self.machines is not None and plan.node_rank == 0:
            self.machines.finished()
            # The store lives as long as this launcher: wait for every other machine.
            late = self.machines.wait_for_others(limit=60.0)
            if late:
                print(f"lockstep run: machines {late} still run 60 s after this one's "
                      "workers ended; closing the job's store", file=sys.stderr, flush=True)
        self.store.set("done", "1")  # spares still waiting exit on their own
        _stop({i: p for i, p in enumerate(self.spares)}, grace=_STOP_GRACE_S)
        if self.machines is not None and plan.node_rank != 0:
            # Only now, with this machine's spares gone: machine 0 closes the store once every
            # machine says it finished, and a spare's thread still polling it printed a
            # "Broken pipe" trace after a job that had succeeded.
            self.machines.finished()
        return 0

    def stop_all(self) -> None:
        _stop({**self.procs, **{-1 - i: p for i, p in enumerate(self.spares)}})


def _stop(procs: dict[int, Worker], grace: float | None = None) -> None:
    """SIGTERM every worker, SIGKILL those still running after a grace period.

    ``grace``: first wait that long for them to exit on their own, then SIGTERM.
    """
    if grace is not None:
        deadline = time.monotonic() + grace
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
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
