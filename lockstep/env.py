"""Who am I: this process's place in the job, read once from what the launcher set.

Launchers announce a worker's place through environment variables. torchrun (and
``lockstep run``) set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
SLURM's ``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NODELIST``.
With neither, the process is a world of one. Everything here is pure logic on a mapping,
so it is tested without processes.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "LOOPBACK_IFNAME",
    "SURVIVORS_ENV",
    "ProcessInfo",
    "default_backend",
    "detect_process_info",
    "env_int",
    "expand_slurm_nodelist",
    "expand_slurm_tasks_per_node",
    "loopback_gloo",
    "loopback_interface",
    "parse_env_int",
    "threads_per_share",
    "usable_cores",
]

LOOPBACK_IFNAME = "lo"  # Linux's name for the loopback interface

# "1": set by ``lockstep run --survivors`` in its workers (lockstep.resilience.Survivors).
SURVIVORS_ENV = "LOCKSTEP_SURVIVORS"

# SLURM gives no port; derive one from the job id so every task of a job agrees on it
# without talking, and two jobs sharing a node rarely collide.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class ProcessInfo:
    """An immutable description of this process in the job.

    Attributes:
        rank: global rank, in ``[0, world_size)``.
        local_rank: rank among the workers on this machine (picks the GPU).
        world_size: number of workers in the job.
        local_world_size: number of workers on this machine.
        master_addr: host of the rendezvous store (rank 0's machine).
        master_port: port of the rendezvous store.
        source: who set the environment: ``"torchrun"``, ``"slurm"`` or ``"single"``.
        device: this rank's device, once :func:`lockstep.init_distributed` chose it.
        backend: the process group backend (``"gloo"``/``"nccl"``), once initialised.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "single"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def parse_env_int(name: str, text: str, least: int | None = None, example: int | None = None) -> int:
    """The whole number environment variable ``name`` holds as ``text``.

    Raises:
        ValueError: not a whole number, or below ``least``; the message names the variable.
    """
    try:
        value = int(text)
    except ValueError:
        hint = f"; unset it or give e.g. {name}={example}" if example is not None else ""
        raise ValueError(f"environment variable {name}={text!r} is not a whole number{hint}") from None
    if least is not None and value < least:
        raise ValueError(f"environment variable {name}={value}: must be at least {least}")
    return value


def env_int(environ: Mapping[str, str], name: str, default: int | None = None,
            least: int | None = None, example: int | None = None) -> int | None:
    """The whole number in ``environ[name]``, or ``default`` when it is unset or empty.

    Raises:
        ValueError: as :func:`parse_env_int`.
    """
    text = environ.get(name, "")
    return default if not text else parse_env_int(name, text, least, example)


def _int(env: Mapping[str, str], name: str) -> int:
    return parse_env_int(name, env[name])


def loopback_interface() -> str | None:
    """The loopback interface's name (``"lo"``) where this machine has one, else None."""
    if not hasattr(socket, "if_nameindex"):
        return None
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return LOOPBACK_IFNAME if LOOPBACK_IFNAME in names else None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


# Set with the OMP_NUM_THREADS that ``lockstep run`` chose itself (not one the user set).
OMP_FROM_LAUNCHER_ENV = "LOCKSTEP_OMP_FROM_LAUNCHER"


def threads_per_share(shares: int) -> int:
    """Intra-op threads for one of ``shares`` equal shares of the usable cores (at least 1):
    what ``lockstep run`` gives each worker, with ``shares`` its worker count, or the virtual
    shard count with ``--virtual-shards``."""
    return max(1, usable_cores() // max(1, shares))


def loopback_gloo(environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` to keep gloo's sockets on loopback for a single-machine world.

    gloo otherwise listens on the address the host name resolves to, which may face a network.
    Empty where the user chose an interface or the machine has no ``lo``.
    """
    if "GLOO_SOCKET_IFNAME" in environ:
        return {}
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name} if name is not None else {}


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, e.g. ``"gpu[01-03,07],cpu1"``.

    Returns:
        The host names in order: ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]``.
    """
    hosts: list[str] = []
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist + ","):  # split on the commas outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    for item in items:
        if item:
            hosts.extend(_expand_brackets(item))
    if not hosts:
        raise ValueError(f"SLURM_NODELIST={nodelist!r} names no host")
    return hosts


def _expand_brackets(item: str) -> list[str]:
    """One host expression, every bracket group expanded in order (``rack[1-2]-n[01-02]``:
    ``rack1-n01, rack1-n02, rack2-n01, rack2-n02``, as ``scontrol show hostnames``)."""
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        return [item]
    prefix, ranges, suffix = match.groups()
    heads: list[str] = []
    for part in ranges.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            heads.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            heads.append(f"{prefix}{part}")
    tails = _expand_brackets(suffix)
    return [head + tail for head in heads for tail in tails]


def expand_slurm_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list, e.g. ``"4,2(x3)"``.

    Returns:
        The task count of each node in order: ``[4, 2, 2, 2]``.

    Raises:
        ValueError: the value is not in SLURM's ``N`` / ``N(xK)`` comma-separated form.
    """
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(
                f"SLURM tasks-per-node value {value!r} is not of the form '4' or '4,2(x3)'"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_local_world_size(env: Mapping[str, str], rank: int, local_rank: int) -> int:
    """Workers on this node: from the step's tasks-per-node list, which SLURM always sets.

    ``SLURM_NTASKS_PER_NODE`` exists only when ``--ntasks-per-node`` was given; the
    ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` lists exist for every job step.
    """
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_slurm_tasks_per_node(env[name])
            if "SLURM_NODEID" in env:
                node = _int(env, "SLURM_NODEID")
            else:  # block distribution (SLURM's default): ranks fill node 0 first
                node, first = 0, 0
                while node < len(counts) - 1 and rank >= first + counts[node]:
                    first += counts[node]
                    node += 1
            if 0 <= node < len(counts):
                return counts[node]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return int(per_node) if per_node.isdigit() else max(local_rank + 1, 1)


def detect_process_info(environ: Mapping[str, str] | None = None) -> ProcessInfo:
    """Read this process's place in the job from the environment.

    torchrun's variables win over SLURM's (torchrun started inside an allocation sets both).

    Raises:
        ValueError: a variable is malformed, or the rank lies outside the world.
    """
    env = os.environ if environ is None else environ
    if ("RANK" in env) != ("WORLD_SIZE" in env):  # torch's env:// refuses half of the pair too
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"{have} is set ({env[have]!r}) but {lack} is not: a launcher sets both (torchrun, "
            f"lockstep run); set {lack} too, or unset {have} to run as a world of one"
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500
        info = ProcessInfo(rank, local_rank, world, local_world, addr, port, "torchrun")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_world = _slurm_local_world_size(env, rank, local_rank)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        try:
            addr = env.get("MASTER_ADDR") or expand_slurm_nodelist(nodelist)[0]
        except (ValueError, IndexError) as err:
            raise ValueError(f"SLURM_NODELIST={nodelist!r} is not a node list SLURM writes "
                             f"({err}); set MASTER_ADDR to the first node's address") from None
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
            port = _SLURM_PORT_BASE + job % _SLURM_PORT_SPAN
        info = ProcessInfo(rank, local_rank, world, local_world, addr, port, "slurm")
    else:
        return ProcessInfo()
    if not 0 <= info.master_port <= 65535:
        raise ValueError(f"MASTER_PORT={info.master_port} is not a port: give one in 0-65535")
    if info.world_size < 1:
        raise ValueError(f"world size must be at least 1, the environment says {info.world_size}")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(
            f"rank {info.rank} is outside [0, {info.world_size}): check RANK/SLURM_PROCID "
            "against WORLD_SIZE/SLURM_NTASKS"
        )
    return info


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs: it exists and is not a zombie (one
    killed and not yet reaped has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # it exists, owned by another user
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS): it exists
        return True
