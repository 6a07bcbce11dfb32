"""``lockstep run``'s arguments: torchrun's flags, validated into an elastic ``LaunchConfig``.

Everything here is pure logic (no process is started), so every argument error is tested
without a launch. An argument that cannot work raises ``ValueError`` naming the flag, the
value and what to do instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher.api import LaunchConfig

from lockstep.launcher.rendezvous import (
    C10D_BACKEND,
    LOOPBACK_BACKEND,
    LOOPBACK_HOST,
    is_loopback_host,
)

__all__ = [
    "LaunchPlan",
    "add_run_arguments",
    "auto_nproc",
    "loopback_gloo",
    "omp_threads",
    "parse_endpoint",
    "parse_nnodes",
    "plan_from_args",
    "to_launch_config",
]

DEFAULT_RDZV_PORT = 29400  # torchrun's default for the c10d rendezvous
_LOOPBACK_IFNAME = "lo"  # Linux's name for the loopback interface
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


# torchrun's flags: (name, argparse options). Each is accepted as --a-b and --a_b.
_FLAGS: tuple[tuple[str, dict], ...] = (
    ("nproc-per-node", dict(default="1", metavar="N|auto",
                            help="workers on this machine; auto: one per GPU, else 2")),
    ("nnodes", dict(default="1", metavar="N|MIN:MAX", help="number of machines in the job")),
    ("node-rank", dict(type=int, default=0, metavar="R",
                       help="this machine's rank (static rendezvous; c10d numbers machines)")),
    ("rdzv-endpoint", dict(default="", metavar="HOST:PORT",
                           help="where the machines meet; needed with --nnodes > 1")),
    ("rdzv-backend", dict(default="c10d", choices=["c10d", "static"], help="rendezvous backend")),
    ("rdzv-id", dict(default="none", help="job id shared by every machine of the job")),
    ("rdzv-conf", dict(default="", metavar="K=V,...", help="extra rendezvous settings")),
    ("master-addr", dict(default=LOOPBACK_HOST, help="static rendezvous host")),
    ("master-port", dict(type=int, default=None, help="static rendezvous port")),
    ("max-restarts", dict(type=int, default=0, metavar="K",
                          help="restart every worker up to K times after a failure")),
    ("monitor-interval", dict(type=float, default=0.1, metavar="SECONDS",
                              help="how often the launcher checks on its workers")),
    ("local-addr", dict(default=None, help="this machine's address as other machines reach it")),
    ("log-dir", dict(default=None, help="keep every worker's stdout/stderr/error files here")),
    ("local-ranks-filter", dict(default="", metavar="R,...",
                                help="show only these local ranks' output on the console")),
)  # fmt: skip


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's flags (both ``--nproc-per-node`` and ``--nproc_per_node`` spellings)."""
    for name, options in _FLAGS:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('-', '_')}"])
        parser.add_argument(*spellings, **options)
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="a single-machine job on loopback (what one machine gets anyway)",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run TRAINING_SCRIPT as a module, like python -m",
    )
    parser.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run TRAINING_SCRIPT as an executable, not with Python",
    )
    parser.add_argument("training_script", help="the script every worker runs")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
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
    if value in ("auto", "gpu", "cpu"):
        return auto_nproc() if value != "cpu" else _CPU_WORKERS_AUTO
    try:
        nproc = int(value)
    except ValueError:
        raise ValueError(f"--nproc-per-node {value!r} is not a number or 'auto'") from None
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {nproc}: a machine needs at least 1 worker")
    return nproc


def omp_threads(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for workers sharing a machine, unless the user chose it.

    Several workers each running one OpenMP thread per core oversubscribe the CPU many times
    over; each gets an equal share of the cores this process may use instead.
    """
    if nproc < 2 or "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // nproc))}


def loopback_gloo(environ: Mapping[str, str]) -> dict[str, str]:
    """Keep gloo's listening sockets on loopback for a single-machine job.

    gloo otherwise listens on the address the host name resolves to, which may face a network.
    """
    if "GLOO_SOCKET_IFNAME" in environ or not hasattr(socket, "if_nameindex"):
        return {}
    names = {name for _, name in socket.if_nameindex()}
    return {"GLOO_SOCKET_IFNAME": _LOOPBACK_IFNAME} if _LOOPBACK_IFNAME in names else {}


def _rdzv_configs(text: str) -> dict[str, str]:
    configs = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE")
        configs[key.strip()] = value.strip()
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
    if args.module or args.no_python or os.path.isfile(script):
        return
    where = os.path.abspath(script)
    hint = " (it is a folder)" if os.path.isdir(script) else ""
    raise ValueError(f"training script {script!r} does not exist{hint}: looked for {where}")


def _rendezvous(args: argparse.Namespace, max_nodes: int) -> tuple[str, str, str, dict]:
    """(backend, endpoint, run id, configs) for the launch."""
    configs = _rdzv_configs(args.rdzv_conf)
    if args.rdzv_backend == "static":
        port = args.master_port if args.master_port is not None else 29500
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{port}"
        host, port = parse_endpoint(endpoint, default_port=29500)
        configs["rank"] = args.node_rank
        return "static", f"{host}:{port}", args.rdzv_id, configs
    if not args.rdzv_endpoint or args.standalone:
        if max_nodes > 1:
            raise ValueError(
                f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, an address every "
                "machine of the job can reach (the first machine's)"
            )
        # One machine: a fresh job id and a free port, nothing reachable from outside.
        return LOOPBACK_BACKEND, f"{LOOPBACK_HOST}:0", uuid.uuid4().hex, configs
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
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval {args.monitor_interval}: must be positive")
    _check_script(args)
    backend, endpoint, run_id, configs = _rendezvous(args, max_nodes)
    local_addr = args.local_addr
    if local_addr is None and backend == LOOPBACK_BACKEND:
        local_addr = LOOPBACK_HOST  # workers of a loopback job meet on loopback too
    worker_env = omp_threads(nproc, environ)
    if backend == LOOPBACK_BACKEND:
        worker_env.update(loopback_gloo(environ))
    entrypoint, cmd = _command(args, environ)
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
    )


def to_launch_config(plan: LaunchPlan, log_dir: str) -> LaunchConfig:
    """The elastic ``LaunchConfig`` for ``plan``, logging every worker under ``log_dir``.

    Workers write to files only: :class:`~lockstep.launcher.output.OutputRelay` copies them
    to the console with rank prefixes, and the root-cause report reads a failed worker's last
    lines there.
    """
    logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.NONE)
    return LaunchConfig(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        nproc_per_node=plan.nproc_per_node,
        logs_specs=logs,
        run_id=plan.run_id,
        role="default",  # torchrun's ROLE_NAME
        rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_backend=plan.rdzv_backend,
        rdzv_configs=dict(plan.rdzv_configs),
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        local_addr=plan.local_addr,
    )
