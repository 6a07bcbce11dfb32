"""A launch plan: ``lockstep run``'s arguments, validated, and the elastic config made from it.

Everything here is pure logic (no process is started), so every argument error is tested
without a launch. An argument that cannot work raises ``ValueError`` naming the flag, the
value and what to do instead; a :class:`LaunchPlan` built by hand is checked the same way.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher.api import LaunchConfig

from lockstep.launcher.rendezvous import (
    C10D_BACKEND,
    LOOPBACK_BACKEND,
    LOOPBACK_HOST,
    STATIC_BACKEND,
    is_loopback_host,
)
from lockstep.launcher.worker_env import loopback_gloo, omp_threads
from lockstep.virtual_world import virtual_shards_env

__all__ = [
    "DEFAULT_RDZV_PORT",
    "DEFAULT_SIGNALS",
    "SIGNALS_ENV",
    "LaunchPlan",
    "auto_nproc",
    "parse_endpoint",
    "parse_nnodes",
    "plan_from_args",
    "to_launch_config",
]

DEFAULT_RDZV_PORT = 29400  # torchrun's default for the c10d rendezvous
_CPU_WORKERS_AUTO = 2  # `--nproc-per-node auto` without GPUs: enough to exercise data parallelism


@dataclass(frozen=True)
class LaunchPlan:
    """A validated launch: what to start, where, and how it meets the other nodes."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    node_rank: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    max_restarts: int
    monitor_interval: float
    entrypoint: str
    args: tuple[str, ...]
    worker_env: dict[str, str] = field(default_factory=dict)
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    log_dir: str | None = None
    local_ranks_filter: frozenset[int] | None = None
    survivors: bool = False  # --survivors: lockstep.launcher.survivors supervises the workers
    spares: int = 1  # with survivors: warm spare workers
    node_timeout: float = 10.0  # with survivors on several machines: silence that counts lost
    fork_workers: bool = True  # with restarts: workers forked from a server that has torch
    role: str = "default"  # torchrun's --role: the workers' ROLE_NAME
    # torchrun's settings of the elastic agent given on the command line, as LaunchConfig fields
    agent_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse a plan that cannot work, however it was built (flags or by hand)."""
        counts = {"nproc_per_node": self.nproc_per_node, "min_nodes": self.min_nodes,
                  "max_nodes": self.max_nodes, "node_rank": self.node_rank,
                  "max_restarts": self.max_restarts}  # fmt: skip
        for name, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"LaunchPlan.{name} must be an int, got {value!r}")
        if self.nproc_per_node < 1:
            raise ValueError(
                f"--nproc-per-node {self.nproc_per_node}: a machine needs at least 1 worker"
            )
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX"
            )
        if not 0 <= self.node_rank < self.max_nodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is outside [0, {self.max_nodes}) for "
                f"--nnodes {self.max_nodes}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if not self.monitor_interval > 0:
            raise ValueError(f"--monitor-interval {self.monitor_interval}: must be positive")
        if not self.entrypoint or not self.rdzv_endpoint or not self.rdzv_backend:
            raise ValueError("a launch plan needs an entrypoint, a rendezvous backend and endpoint")
        if not isinstance(self.spares, int) or self.spares < 0:
            raise ValueError(f"--spares {self.spares}: must be 0 or more")
        if self.survivors and self.min_nodes != self.max_nodes:
            raise ValueError(
                f"--survivors needs a fixed number of machines; this job has --nnodes "
                f"{self.min_nodes}:{self.max_nodes}. Give --nnodes N (a lost machine's ranks "
                "leave the world and a launcher started again for it brings replacements), or "
                "drop --survivors (every worker restarts after a failure, with --max-restarts)."
            )
        if self.survivors and self.max_nodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError(
                "--survivors on several machines needs --rdzv-endpoint HOST:PORT with a fixed "
                "port: machine 0's launcher hosts the job's store there"
            )
        if not self.node_timeout > 0:
            raise ValueError(f"--node-timeout {self.node_timeout}: must be positive seconds")
        outside = sorted(set(self.local_ranks_filter or ()) - set(range(self.nproc_per_node)))
        if outside:
            raise ValueError(
                f"--local-ranks-filter {','.join(map(str, sorted(self.local_ranks_filter or ())))}"
                f": local rank(s) {outside} are not in this job, whose local ranks are "
                f"0-{self.nproc_per_node - 1} (--nproc-per-node {self.nproc_per_node}); "
                "pick among those, or drop the flag to see every worker"
            )


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4)."""
    parts = value.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"--nnodes {value!r} is not N or MIN:MAX, e.g. --nnodes 2") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {value!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """``"host:port"`` or ``"[::1]:port"`` (port optional) -> (host, port)."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            host = ""
        port_text = rest[1:] if rest else ""
    else:
        host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        if sep and not port_text:
            port_text = "(empty)"
    problem = None
    if not host or any(c.isspace() for c in host) or ":" in host and not text.startswith("["):
        problem = "has no valid host"
    elif port_text and not port_text.isdigit():
        problem = f"has a port {port_text!r} that is not a number"
    elif port_text and not 0 <= int(port_text) <= 65535:
        problem = f"has a port {port_text} outside 0-65535"
    if problem:
        raise ValueError(
            f"--rdzv-endpoint {endpoint!r} {problem}: write HOST:PORT, e.g. 10.0.0.1:29400"
        )
    return host, int(port_text) if port_text else default_port


def auto_nproc() -> int:
    """One worker per GPU, or two CPU workers on a machine without GPUs."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return _CPU_WORKERS_AUTO


def _parse_nproc(value: str) -> int:
    """torchrun's values: a number; ``auto`` (one per GPU, here 2 without GPUs); ``cpu`` (one per
    usable core, as torchrun); ``gpu`` (one per GPU; an error without one, as torchrun)."""
    if value == "auto":
        return auto_nproc()
    if value == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if value == "gpu":
        if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
            raise ValueError("--nproc-per-node gpu: CUDA is not available here; give a number of "
                             "workers, or 'auto' (2 CPU workers without GPUs)")
        return torch.cuda.device_count()
    try:
        nproc = int(value)
    except ValueError:
        raise ValueError(f"--nproc-per-node {value!r} is not a number, 'auto', 'cpu' or 'gpu'") from None
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {nproc}: a machine needs at least 1 worker")
    return nproc


# --rdzv-conf keys the rendezvous reads as whole seconds or counts, and as yes/no.
_WHOLE_NUMBER_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                      "timeout", "read_timeout", "keep_alive_interval", "keep_alive_max_attempt")
_YES_NO = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")


def _rdzv_configs(text: str) -> dict[str, str]:
    configs = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE")
        key, value = key.strip(), value.strip()
        if key in _WHOLE_NUMBER_KEYS and not value.isdigit():
            raise ValueError(f"--rdzv-conf {key}={value!r}: {key} takes a whole number "
                             f"(seconds, or a count), e.g. {key}=60")
        if key == "is_host" and value.lower() not in _YES_NO:
            raise ValueError(f"--rdzv-conf is_host={value!r}: is_host takes 1 or 0 "
                             "(true/false, yes/no)")
        configs[key] = value
    return configs


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r} is not a list like 0,1") from None


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        _check_module(script)
        return
    if args.no_python:
        _check_program(script)
        return
    if os.path.isfile(script):
        return
    where = os.path.abspath(script)
    hint = " (it is a folder)" if os.path.isdir(script) else ""
    raise ValueError(f"training script {script!r} does not exist{hint}: looked for {where}")


def _check_program(program: str) -> None:
    """``--no-python``: the program must be found (on PATH, or as a path) and executable."""
    if shutil.which(program) is not None:
        return
    if os.sep in program:
        if not os.path.exists(program):
            raise ValueError(f"--no-python program {program!r} does not exist: looked for "
                             f"{os.path.abspath(program)}")
        if os.path.isdir(program):
            raise ValueError(f"--no-python program {program!r} is a folder, not a program")
        raise ValueError(f"--no-python program {program!r} is not executable: chmod +x "
                         f"{program}")
    hint = (f" (a file of that name is in this folder: give it as ./{program})"
            if os.path.isfile(program) else "")
    raise ValueError(f"--no-python program {program!r} is not found on PATH{hint}")


def _rendezvous(args: argparse.Namespace, max_nodes: int) -> tuple[str, str, str, dict]:
    """(backend, endpoint, run id, configs) for the launch."""
    configs = _rdzv_configs(args.rdzv_conf)
    if args.rdzv_backend not in ("c10d", "static"):  # (a PET_RDZV_BACKEND default is not checked)
        raise ValueError(f"--rdzv-backend {args.rdzv_backend!r} (or PET_RDZV_BACKEND) is not supported: "
                         "use c10d (the default) or static")
    if args.rdzv_backend == "static":
        port = args.master_port if args.master_port is not None else 29500
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{port}"
        host, port = parse_endpoint(endpoint, default_port=29500)
        configs["rank"] = args.node_rank
        return "static", f"{host}:{port}", args.rdzv_id, configs
    if not args.rdzv_endpoint or args.standalone:
        if max_nodes > 1 and args.standalone:
            raise ValueError(
                f"--standalone runs on one machine but --nnodes {args.nnodes} asks for "
                f"{max_nodes}: drop --standalone (and give --rdzv-endpoint HOST:PORT) "
                "or drop --nnodes"
            )
        if max_nodes > 1:
            raise ValueError(
                f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, an address every "
                "machine of the job can reach (the first machine's)"
            )
        # One machine: a free port, nothing reachable from outside. The job id is the
        # --rdzv-id given (workers read it as TORCHELASTIC_RUN_ID; a script may name its runs
        # after it), as torchrun keeps it; --standalone makes a fresh one, as torchrun's does.
        run_id = uuid.uuid4().hex if args.standalone else args.rdzv_id
        return LOOPBACK_BACKEND, f"{LOOPBACK_HOST}:0", run_id, configs
    host, port = parse_endpoint(args.rdzv_endpoint)
    if port == 0 and max_nodes > 1:
        raise ValueError(
            f"--rdzv-endpoint {args.rdzv_endpoint!r}: port 0 cannot be shared between machines; "
            "give a fixed port, e.g. 29400"
        )
    backend = LOOPBACK_BACKEND if is_loopback_host(host) else C10D_BACKEND
    return backend, f"{host}:{port}", args.rdzv_id, configs


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """The program each worker runs, and its arguments."""
    if args.no_python:
        return args.training_script, tuple(args.training_script_args)
    # -u: workers' lines reach the console as they are printed, not when a buffer fills.
    python = environ.get("PYTHON_EXEC", sys.executable)
    cmd = ["-u", "-m", "lockstep.launcher.worker"] + (["-m"] if args.module else [])
    return python, (*cmd, args.training_script, *args.training_script_args)


def plan_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> LaunchPlan:
    """Validate parsed ``lockstep run`` arguments into a :class:`LaunchPlan`.

    Raises:
        ValueError: an argument that cannot work, named with what to do instead.
    """
    environ = os.environ if environ is None else environ
    nproc = _parse_nproc(str(args.nproc_per_node))
    min_nodes, max_nodes = parse_nnodes(str(args.nnodes))
    if not 0 <= args.node_rank < max_nodes:
        raise ValueError(
            f"--node-rank {args.node_rank} is outside [0, {max_nodes}) for --nnodes {args.nnodes}"
        )
    _check_script(args)
    backend, endpoint, run_id, configs = _rendezvous(args, max_nodes)
    local_addr = args.local_addr
    if local_addr is None and backend == LOOPBACK_BACKEND:
        local_addr = LOOPBACK_HOST  # workers of a loopback job meet on loopback too
    worker_env = omp_threads(nproc, environ, getattr(args, "virtual_shards", None))
    if getattr(args, "virtual_shards", None) is not None:
        worker_env.update(virtual_shards_env(args.virtual_shards, nproc, min_nodes, max_nodes))
    static_on_loopback = backend == "static" and is_loopback_host(endpoint.rsplit(":", 1)[0])
    if backend == LOOPBACK_BACKEND or static_on_loopback:
        worker_env.update(loopback_gloo(environ))  # gloo's sockets stay on this machine
    entrypoint, cmd = _command(args, environ)
    survivors, spares, node_timeout = _survivor_flags(args)
    return LaunchPlan(
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=args.node_rank,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        entrypoint=entrypoint,
        args=cmd,
        worker_env=worker_env,
        rdzv_configs=configs,
        local_addr=local_addr,
        log_dir=args.log_dir,
        local_ranks_filter=_ranks_filter(args.local_ranks_filter),
        survivors=survivors,
        spares=spares,
        node_timeout=node_timeout,
        fork_workers=not getattr(args, "no_fork", False),
        role=getattr(args, "role", "default"),
        agent_options=_agent_options(args, survivors),
    )


# torchrun's flags for its elastic agent: (LaunchConfig field, default).
_AGENT_FLAGS = {
    "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "shutdown_timeout": None,
    "virtual_local_rank": False,
    "numa_binding": None,
    "duplicate_stdout_filters": "",
    "duplicate_stderr_filters": "",
    "event_log_handler": "null",
}
DEFAULT_SIGNALS = _AGENT_FLAGS["signals_to_handle"]
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # where torch's launcher tells its workers


def _agent_options(args: argparse.Namespace, survivors: bool) -> dict[str, Any]:
    """The agent settings given on the command line, as ``LaunchConfig`` takes them.

    Raises:
        ValueError: ``--logs-specs`` (lockstep writes the logs), a setting this torch's agent
            does not have (it came with a later torch), or any of them with ``--survivors``.
    """
    if getattr(args, "logs_specs", None):
        raise ValueError("--logs-specs is not supported: lockstep run writes every worker's output "
                         "itself (to the console, and with --log-dir to files); leave it out")
    given = {name: getattr(args, name) for name, default in _AGENT_FLAGS.items()
             if getattr(args, name, default) != default}
    if given and survivors:
        raise ValueError(f"--{next(iter(given)).replace('_', '-')} is a setting of torch's elastic agent, "
                         "which --survivors does not use; leave it out")
    options: dict[str, Any] = {}
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        if name == "shutdown_timeout" and value < 0:
            raise ValueError(f"{flag} {value}: give the seconds to wait, 0 or more")
        if name == "numa_binding":
            try:
                from torch.numa.binding import AffinityMode, NumaOptions
            except ImportError:
                raise ValueError(f"{flag} needs a torch with torch.numa.binding (this is torch "
                                 f"{torch.__version__})") from None
            modes = [mode.value for mode in AffinityMode]
            if value not in modes:
                raise ValueError(f"{flag} {value!r}: use one of {', '.join(modes)}")
            name, value = "numa_options", NumaOptions(affinity_mode=AffinityMode(value))
        elif name.startswith("duplicate_"):
            value = [part for part in value.split(",") if part]
        options[name] = value
    known = {f.name for f in fields(LaunchConfig)}
    for name in options:
        if name not in known:
            flag = "--numa-binding" if name == "numa_options" else "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: torch {torch.__version__}'s elastic agent has no such "
                             "setting (torchrun added it later); upgrade torch or leave it out")
    return options


def _survivor_flags(args: argparse.Namespace) -> tuple[bool, int, float]:
    """``--survivors``, ``--spares`` (default 1) and ``--node-timeout`` (default 10 s), checked
    together: the last two mean nothing without the first, which needs replacements to give."""
    survivors = bool(getattr(args, "survivors", False))
    spares, node_timeout = getattr(args, "spares", None), getattr(args, "node_timeout", None)
    if not survivors:
        given = [flag for flag, value in (("--spares", spares), ("--node-timeout", node_timeout))
                 if value is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --survivors (warm spares and lost "
                "machines of a job whose survivors keep training): add --survivors, or drop "
                f"{' and '.join(given)}"
            )
    else:
        if args.max_restarts < 1:
            raise ValueError(
                "--survivors gives a dead rank a replacement while --max-restarts allows; "
                f"with --max-restarts {args.max_restarts} the first failure would stop the "
                "whole job: give --max-restarts N (replacements allowed, e.g. 3)"
            )
        if getattr(args, "log_dir", None):
            raise ValueError(
                "--log-dir is not supported with --survivors: every worker's output goes to "
                "this launcher's console, each line prefixed with its rank (redirect it, e.g. "
                "`lockstep run --survivors ... 2>&1 | tee job.log`)"
            )
    return (survivors, 1 if spares is None else spares,
            10.0 if node_timeout is None else node_timeout)


def to_launch_config(plan: LaunchPlan, log_dir: str,
                     start_method: str | None = None) -> LaunchConfig:
    """The elastic ``LaunchConfig`` for ``plan``, logging every worker under ``log_dir``.

    ``start_method`` is how the agent starts a function entry point (``"forkserver"``: workers
    forked from :mod:`lockstep.launcher.zygote`'s server); torch's default otherwise. Workers
    write to files only: :class:`~lockstep.launcher.output.OutputRelay` copies them
    to the console with rank prefixes, and the root-cause report reads a failed worker's last
    lines there.
    """
    logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.NONE)
    configs: dict = dict(plan.rdzv_configs)
    if plan.rdzv_backend in (LOOPBACK_BACKEND, C10D_BACKEND) and plan.max_nodes > 1:
        # lockstep's rendezvous then says what it waits for and who joined or left
        # (lockstep.launcher.rendezvous_report); a single machine has nobody to wait for.
        configs.update(lockstep_nproc=plan.nproc_per_node, lockstep_log_dir=log_dir,
                       lockstep_max_restarts=plan.max_restarts)
    config = LaunchConfig(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        nproc_per_node=plan.nproc_per_node,
        logs_specs=logs,
        run_id=plan.run_id,
        role=plan.role,  # torchrun's ROLE_NAME
        rdzv_endpoint=plan.rdzv_endpoint,
        # static: torch's handler, wrapped so that machine 0 leaves last (static_rendezvous)
        rdzv_backend=STATIC_BACKEND if plan.rdzv_backend == "static" else plan.rdzv_backend,
        rdzv_configs=configs,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        local_addr=plan.local_addr,
    )
    for name, value in plan.agent_options.items():  # torchrun's agent flags, as given
        setattr(config, name, value)
    if start_method:  # a function entry point's (lockstep.launcher.run): torch's default is spawn
        config.start_method = start_method
    return config


def _check_module(name: str) -> None:
    """Refuse ``-m NAME`` whose top-level package no worker could import, before any starts.

    Only the top-level name is looked up (a dotted name's parents would be imported, running
    their code in the launcher), on the path a worker's ``python -m`` gets: the working
    directory first.
    """
    top = name.split(".")[0]
    if not top or top in sys.builtin_module_names:
        return
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
        raise ValueError(f"-m {name}: no module named {top!r} in the working directory "
                         f"{os.getcwd()} or on the Python path (check the name, PYTHONPATH, or "
                         "the folder you start from)")
