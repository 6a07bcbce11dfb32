"""Setting up and tearing down the default process group from what the launcher set."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.diagnose import progress
from lockstep.env import (
    SURVIVORS_ENV,
    ProcessInfo,
    default_backend,
    detect_process_info,
    loopback_interface,
)
from lockstep.rejoin import LeftGroups
from lockstep.teardown import quiesce

__all__ = [
    "DeviceUnavailableError", "current_process_info", "global_rank", "global_ranks",
    "init_distributed", "leave_safely_at_exit", "pick_device", "resolve_device", "resolve_group",
    "shutdown_distributed",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)

# The default groups this process left (lockstep.rejoin): process-wide, like the default
# group itself, which they outlive.
_LEFT = LeftGroups()


class DeviceUnavailableError(ValueError, RuntimeError):
    """A device was asked for that this process cannot use (no such GPU, no CUDA).

    The one type for that error wherever a device is resolved (``init_distributed``,
    ``DataParallel(device_ids=...)``); it is both a ``RuntimeError`` (as torch raises for a
    missing GPU) and a ``ValueError`` (a bad argument), so either ``except`` catches it.
    """


def pick_device(local_rank: int) -> torch.device:
    """This rank's device: GPU number ``local_rank`` where there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceUnavailableError(
                f"local rank {local_rank} has no GPU: this machine has {count}. "
                "Start at most one worker per GPU (e.g. `lockstep run --nproc-per-node auto`)."
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_device(device: torch.device | str | int | None, local_rank: int) -> torch.device:
    """This rank's device from what was asked: ``cuda`` without an index is GPU ``local_rank``.

    Args:
        device: ``None`` (GPU ``local_rank`` where there are GPUs, else the CPU), a device, a
            string such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``, or a GPU number.
        local_rank: this process's rank on its node.

    Raises:
        DeviceUnavailableError: (a RuntimeError) CUDA was asked for but this torch build has
            none, no GPU is visible, or the GPU named (or ``local_rank``) does not exist here.
        ValueError: ``device`` is not a device name.
    """
    if device is None:
        return pick_device(local_rank)
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a device name (e.g. 'cpu', 'cuda', 'cuda:0'): {e}") from None
    if dev.type != "cuda":
        return dev
    if not torch.backends.cuda.is_built():
        raise DeviceUnavailableError(
            f"CUDA requested (device={str(device)!r}) but this torch build has no CUDA "
            f"(torch {torch.__version__}): install a CUDA build of torch, or run on the CPU "
            "(device='cpu', or LOCKSTEP_DEVICE=cpu)."
        )
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"CUDA requested (device={str(device)!r}) but no GPU is visible to this process "
            "(torch.cuda.is_available() is False): check the driver and CUDA_VISIBLE_DEVICES, "
            "or run on the CPU (device='cpu', or LOCKSTEP_DEVICE=cpu)."
        )
    if dev.index is None:
        return pick_device(local_rank)  # "cuda": one GPU per local rank, as torchrun assigns
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise DeviceUnavailableError(
            f"device={str(device)!r} does not exist: this machine has {count} GPU(s) "
            f"(cuda:0 to cuda:{count - 1}). Pass 'cuda' to use GPU number LOCAL_RANK."
        )
    return dev


def current_process_info() -> ProcessInfo:
    """Describe this process from the live default group (or the environment, before one exists)."""
    info = detect_process_info()
    if not dist.is_initialized():
        return info
    backend = str(dist.get_backend())
    device = pick_device(info.local_rank) if "nccl" in backend else torch.device("cpu")
    return replace(
        info, rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, backend=backend
    )


def init_distributed(
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: torch.device | str | None = None,
) -> ProcessInfo:
    """Create the default process group from torchrun's, SLURM's or no environment.

    With no launcher variables set this is a world of one: the group lives in memory
    (a ``HashStore``), nothing listens on the network. Calling it again is harmless and
    returns the same description, with the ``device`` that call asks for; asking then for
    another ``backend`` is refused (the group keeps the one it was made with).

    Args:
        backend: ``"nccl"``/``"gloo"``; by default NCCL for CUDA devices, gloo otherwise.
        timeout: how long a collective may wait for a peer before failing.
        device: this rank's device; by default ``LOCKSTEP_DEVICE`` when set (``cpu`` forces CPU
            workers on a GPU machine), else GPU ``local_rank`` when there are GPUs, else CPU.
            ``"cuda"`` without an index means GPU ``local_rank`` (see :func:`resolve_device`).

    Returns:
        The :class:`~lockstep.env.ProcessInfo` of this process, with device and backend.

    Raises:
        ValueError: the group already exists with another backend than ``backend``.

    Example::

        info = lockstep.init_distributed()
        model = lockstep.DistributedDataParallel(Net().to(info.device))
    """
    leave_safely_at_exit()
    if os.environ.get(SURVIVORS_ENV) == "1" and not dist.is_initialized():
        raise RuntimeError(
            "this worker runs under `lockstep run --survivors`, which re-forms the process "
            "group after a failure: the script must create it with `team = "
            "lockstep.Survivors()` instead of calling init_distributed() (see "
            "docs/checkpoints-and-recovery.md, 'Survivors keep training'), or run it without "
            "--survivors (then --max-restarts restarts every worker)"
        )
    if device is None and os.environ.get("LOCKSTEP_DEVICE"):
        device = os.environ["LOCKSTEP_DEVICE"]  # e.g. force CPU workers on a GPU machine
    if dist.is_initialized():
        info = current_process_info()
        if backend is not None and backend.lower() not in str(dist.get_backend()).lower():
            raise ValueError(
                f"init_distributed(backend={backend!r}): the process group already exists with "
                f"backend {dist.get_backend()!r}, which a second call cannot change; call "
                "lockstep.shutdown_distributed() first, or leave backend unset"
            )
        # The device asked for now, as a first call would resolve it (not the backend's guess).
        return info if device is None else replace(info, device=resolve_device(device, info.local_rank))
    info = detect_process_info()
    dev = resolve_device(device, info.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or default_backend(dev)
    if info.source == "single":
        with _gloo_on_loopback(backend):
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    else:
        # torchrun's env:// reuses the elastic agent's store; SLURM has no variables for it.
        init_method = (
            "env://" if info.source == "torchrun" else f"tcp://{_host(info.master_addr)}:{info.master_port}"
        )
        _LEFT.before_join(info.master_port, timeout.total_seconds())
        if info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            _load_compiler_first()  # this process hosts the job's store
        prefix = _LEFT.prefix()
        try:
            _join(backend, init_method, info, timeout, prefix)
        except RuntimeError as exc:  # torch's DistStoreError, DistNetworkError... among them
            if info.source != "slurm":
                raise
            message = f"{exc}\n{_slurm_join_hint(info, timeout)}"
            try:
                explained = type(exc)(message)
            except TypeError:  # an error type built otherwise: keep the message
                explained = RuntimeError(message)
            raise explained from exc
    logger.debug("rank %d/%d joined with %s on %s", info.rank, info.world_size, backend, dev)
    progress.tracker()  # publish this rank's progress from now on (see lockstep.diagnose.hang)
    return replace(info, device=dev, backend=backend)


def _load_compiler_first() -> None:
    """Import torch.compile's machinery (Dynamo) before rank 0 creates a group that hosts the
    job's store.

    Imported while a group exists (any DistributedDataParallel does, torch's too), Dynamo keeps
    that group's store open after the group is destroyed, so ranks joining a new group in the
    same processes (a sweep between trials) waited for the old store to close until their
    timeout (until 2026-11-29). Imported first, it holds nothing; DDP would import it anyway.
    """
    if "torch._dynamo" not in sys.modules:
        import lockstep._torch_compat_compile  # noqa: F401 - imports Dynamo (see above)


def _slurm_join_hint(info: ProcessInfo, timeout: timedelta) -> str:
    """What to check when SLURM's tasks did not all meet (appended to torch's error)."""
    return (
        f"lockstep: SLURM says this job step has {info.world_size} tasks (SLURM_NTASKS) and "
        f"this process is task {info.rank} (SLURM_PROCID), meeting at "
        f"{info.master_addr}:{info.master_port}; not all of them joined within "
        f"{timeout.total_seconds():g}s. Every task must run this script: start it with `srun "
        "python train.py` (a script run directly in an sbatch script or an salloc shell is one "
        "process, while SLURM_NTASKS counts the allocation's tasks), or one `lockstep run "
        "--nproc-per-node N` per node (examples/slurm/). To run it as a single process there, "
        "unset SLURM_NTASKS and SLURM_PROCID."
    )


def _join(backend: str, init_method: str, info: ProcessInfo, timeout: timedelta,
          prefix: str | None) -> None:
    """Create the default group of a launched world (``prefix``: keys of its own)."""
    if prefix is None:
        dist.init_process_group(
            backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
            timeout=timeout,
        )
    else:  # a group after one this process left: keys of its own (lockstep.rejoin)
        store, _, _ = next(dist.rendezvous(init_method, info.rank, info.world_size, timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(
            backend, store=dist.PrefixStore(prefix, store), rank=info.rank,
            world_size=info.world_size, timeout=timeout,
        )


@contextlib.contextmanager
def _gloo_on_loopback(backend: str) -> Iterator[None]:
    """Make a world of one's gloo device bind to loopback, never to a public interface.

    Gloo picks its interface from GLOO_SOCKET_IFNAME when the group is created; it is set only
    for that moment, and only where the user has not chosen one.
    """
    loopback = loopback_interface()
    if backend != "gloo" or loopback is None or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (None: the default group).

    Collectives name their source and destination globally, whatever group they run in.
    """
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global rank of each rank of ``group``, in group order."""
    return [global_rank(group, r) for r in range(dist.get_world_size(group))]


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group`` itself, or the default group for torch's ``None``.

    Raises:
        RuntimeError: ``None`` was given and no default process group exists.
    """
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError(
            "no process group: call lockstep.init_distributed() first (it works under lockstep "
            "run, torchrun, srun and plain python)."
        )
    return world


def shutdown_distributed() -> None:
    """Destroy the default group if there is one, and let its threads settle; safe to call twice.

    Needs no other rank (destroying a group is local), so it is also safe after an exception.
    You rarely need it: a process that called :func:`init_distributed` does it at exit.
    """
    if dist.is_initialized():
        # watched from before rank 0 can see this rank's exit record (lockstep.rejoin)
        _LEFT.left(progress.default_store(), dist.get_rank())
        progress.close_tracker()  # peers waiting for this rank learn that it exited
        dist.destroy_process_group()
    if not quiesce(timeout=2.0):
        logger.debug("gloo worker threads still busy after teardown")


def leave_safely_at_exit() -> None:
    """Have the end of the process destroy the default group and let gloo's threads settle
    first (:func:`shutdown_distributed`), whoever created the group (see ``lockstep.teardown``).

    Registered again on every call, so it runs before atexit handlers registered earlier (they
    run last first). :func:`init_distributed` calls it; so does ``lockstep.Survivors``, which
    makes its groups itself.
    """
    atexit.unregister(_leave_at_exit)
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    """The atexit teardown: runs while the interpreter is whole, also after an exception."""
    try:
        shutdown_distributed()
    except Exception:
        logger.debug("teardown at exit failed", exc_info=True)


def _host(addr: str) -> str:
    """``addr`` as a URL's host: an IPv6 address in brackets (``[::1]``)."""
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
