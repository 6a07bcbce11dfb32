"""What DDP would save over DataParallel: the same model run both ways, measured.

:func:`compare_dp_ddp` trains ``model_fn()`` for the same steps on the same global batches twice:
under :class:`lockstep.DataParallel` over ``devices`` devices in this process (profiled by its
:class:`~lockstep.doctor.dp_recorder.DataParallelRecorder`, the loss marked as device 0's),
then under :class:`lockstep.DistributedDataParallel` in ``devices`` spawned processes, each
taking its slice of every batch (profiled by the DDP recorder). The report
(:class:`~lockstep.doctor.dp_report.DPvsDDP`) gives both step times, DataParallel's
replication, gather and device-0 shares, and the saving.

On a machine without GPUs both run on the CPU: DataParallel over ``['cpu'] * devices`` (its
CPU replicas run one after another in training mode, see :mod:`lockstep.dp.data_parallel`)
and DDP over gloo, one process per "device", each with its share of the cores. The comparison
is then the one a CPU user faces; on GPUs it is the one torch's documentation describes.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.doctor.dp_report import DPvsDDP

__all__ = ["compare_dp_ddp", "load_models_file"]

ModelFn = Callable[[], nn.Module]
BatchFn = Callable[[int], tuple[Any, torch.Tensor]]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
OptimizerFn = Callable[[Any], torch.optim.Optimizer]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def compare_dp_ddp(
    model_fn: ModelFn,
    batch_fn: BatchFn,
    devices: int = 2,
    *,
    steps: int = 20,
    warmup: int = 5,
    loss_fn: LossFn = nn.functional.mse_loss,
    optimizer_fn: OptimizerFn = _sgd,
    device_type: str | None = None,
    threads: int | None = None,
    timeout: float = 600.0,
    start_method: str | None = None,
) -> DPvsDDP:
    """Run ``model_fn()`` under DataParallel and under DDP on ``devices`` devices; compare.

    Every argument that is a function must be defined at the top level of a module (DDP's
    workers are new processes that import it).

    Args:
        model_fn: builds the model, the same every call (seed inside it).
        batch_fn: ``batch_fn(step) -> (inputs, targets)``, the *global* batch of that step;
            its batch dimension (0) must divide evenly by ``devices``.
        devices: device count: DataParallel's devices and DDP's processes (at least 2).
        steps: steps measured in each run, after ``warmup`` more.
        warmup: first steps left out of the figures.
        loss_fn: ``loss_fn(outputs, targets)``, a mean over the batch.
        optimizer_fn: builds the optimizer from parameters (default SGD, lr 0.01).
        device_type: ``"cuda"`` or ``"cpu"``; default CUDA when ``devices`` GPUs are visible.
        threads: CPU threads in all: DataParallel's process gets them all, each DDP process
            ``threads // devices`` (at least 1); default ``devices`` (a core per "device").
        timeout: seconds before the DDP workers are stopped.
        start_method: how DDP's workers start (:func:`lockstep.spawn`'s argument).

    Returns:
        The measured :class:`~lockstep.doctor.dp_report.DPvsDDP`; ``print(result.table())``.

    Raises:
        ValueError: fewer than 2 devices, ``steps < 1``, ``warmup < 0``, ``threads < 1``, too
            few GPUs, or a batch that does not divide evenly.

    Example::

        result = lockstep.doctor.compare_dp_ddp(make_model, make_batch, devices=2, steps=10)
        print(result.table())     # DataParallel's shares, DDP's step, the saving
    """
    if devices < 2 or steps < 1 or warmup < 0 or (threads is not None and threads < 1):
        raise ValueError(f"compare_dp_ddp: need devices >= 2, steps >= 1, warmup >= 0 and "
                         f"threads >= 1, got devices={devices}, steps={steps}, warmup={warmup}, "
                         f"threads={threads}")
    kind = device_type or ("cuda" if torch.cuda.is_available()
                           and torch.cuda.device_count() >= devices else "cpu")
    if kind == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < devices):
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"compare_dp_ddp: devices={devices} CUDA devices asked for, {seen} "
                         "visible; pass fewer devices or device_type='cpu'")
    inputs, _ = batch_fn(0)
    if inputs.shape[0] % devices:
        raise ValueError(f"compare_dp_ddp: batch_fn(0) gives a batch of {inputs.shape[0]}, which "
                         f"does not split evenly over {devices} devices; give a multiple of "
                         f"{devices} so DataParallel and DDP compute the same mean")
    total = steps + warmup
    threads = threads or devices
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dp_phases, dp_params = _run_data_parallel(model_fn, batch_fn, devices, kind, total, warmup,
                                                  loss_fn, optimizer_fn)
    finally:
        torch.set_num_threads(before)
    from lockstep.launcher.spawn import spawn

    per_process = max(1, threads // devices)
    results = spawn(_ddp_worker, devices, (model_fn, batch_fn, kind, total, warmup, loss_fn,
                                           optimizer_fn), timeout=timeout,
                    threads_per_worker=per_process, start_method=start_method)
    ddp_phases, ddp_params = results[0]
    diff = max((a - b).abs().max().item() for a, b in zip(dp_params, ddp_params))
    notes = []
    if kind == "cpu":
        notes.append(f"CPU: DataParallel's replicas run one after another in one process with "
                     f"{threads} thread(s); DDP runs {devices} gloo processes with "
                     f"{per_process} each")
    return DPvsDDP(devices, kind, steps, warmup, dp_phases, ddp_phases, diff, notes)


def _device(kind: str, index: int) -> torch.device:
    return torch.device(kind, index) if kind == "cuda" else torch.device("cpu")


def _run_data_parallel(
    model_fn: ModelFn, batch_fn: BatchFn, devices: int, kind: str, total: int, warmup: int,
    loss_fn: LossFn, optimizer_fn: OptimizerFn,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    from lockstep.doctor.dp_recorder import DataParallelRecorder
    from lockstep.dp.data_parallel import DataParallel

    first = _device(kind, 0)
    model = DataParallel(model_fn().to(first), device_ids=[_device(kind, i) for i in range(devices)])
    recorder = model.enable_profiling(warmup=warmup)
    assert isinstance(recorder, DataParallelRecorder)  # the doctor's (lockstep.profilers)
    optimizer = optimizer_fn(model.parameters())
    for step in range(total):
        inputs, targets = batch_fn(step)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs.to(first)), targets.to(first))
        recorder.mark("loss")  # the loss on the gathered outputs: device 0's alone
        loss.backward()
        optimizer.step()
    phases = recorder.phases()
    model.enable_profiling(False)
    return phases, [p.detach().cpu() for p in model.module.parameters()]


def _ddp_worker(
    rank: int, model_fn: ModelFn, batch_fn: BatchFn, kind: str, total: int, warmup: int,
    loss_fn: LossFn, optimizer_fn: OptimizerFn,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    from lockstep.ddp.wrapper import DistributedDataParallel
    from lockstep.distributed import init_distributed
    from lockstep.doctor.api import gather_report
    from lockstep.doctor.recorder import Recorder

    info = init_distributed()
    device = _device(kind, info.local_rank)
    model = DistributedDataParallel(model_fn().to(device))
    recorder = model.enable_profiling(warmup=warmup)
    if not isinstance(recorder, Recorder):  # enabled: the doctor's, through lockstep.profilers
        raise TypeError(f"DistributedDataParallel.enable_profiling() returned "
                        f"{type(recorder).__name__}, not the doctor's Recorder")
    optimizer = optimizer_fn(model.parameters())
    for step in range(total):
        inputs, targets = batch_fn(step)
        # This rank's slice of the global batch: the piece DataParallel's scatter gives device r.
        mine = inputs.chunk(info.world_size)[info.rank].to(device)
        wanted = targets.chunk(info.world_size)[info.rank].to(device)
        optimizer.zero_grad()
        loss_fn(model(mine), wanted).backward()
        optimizer.step()
    report = gather_report(recorder)
    return report["phases"], [p.detach().cpu() for p in model.module.parameters()]


def load_models_file(path: str | os.PathLike) -> dict[str, Any]:
    """``model_fn``, ``batch_fn`` (and ``loss_fn``, ``optimizer_fn`` if defined) from a file.

    The file is imported as a module named after it, its folder first on ``sys.path``, so DDP's
    spawned workers import the same functions by name. It is first read without running it: a
    file that does not define ``model_fn`` and ``batch_fn`` at its top level (a training script)
    is refused before any of it runs. While it is imported ``sys.argv`` is ``[file]``, not the
    doctor's own arguments (a module that parses its arguments at import sees none).

    Raises:
        FileNotFoundError: no such file.
        ValueError: it does not parse, defines no ``model_fn`` or no ``batch_fn``, or its import
            failed or exited (the message names the file and the error).
    """
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"lockstep doctor --dp-vs-ddp: no file {file}; pass a .py file "
                                "that defines model_fn() and batch_fn(step)")
    needs = ("it needs model_fn() -> nn.Module and batch_fn(step) -> (inputs, targets), the "
             "global batch, at its top level (loss_fn and optimizer_fn are optional)")
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes
        raise ValueError(f"lockstep doctor --dp-vs-ddp: {file} is not valid Python: {err}; "
                         f"fix it ({needs})") from err
    missing = [name for name in ("model_fn", "batch_fn") if name not in _top_level_names(tree)]
    if missing:
        raise ValueError(f"lockstep doctor --dp-vs-ddp: {file} defines no "
                         f"{' or '.join(missing)}; {needs}. It was not run: --dp-vs-ddp takes a "
                         "models file, not a training script")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    argv = sys.argv
    sys.argv = [str(file)]
    try:
        module = importlib.import_module(file.stem)
    except (Exception, SystemExit) as err:
        raise ValueError(f"lockstep doctor --dp-vs-ddp: {file}: importing it failed with "
                         f"{type(err).__name__}: {err}; {needs}, and importing it must not "
                         "train or exit") from err
    finally:
        sys.argv = argv
    found = {name: getattr(module, name) for name in
             ("model_fn", "batch_fn", "loss_fn", "optimizer_fn") if hasattr(module, name)}
    missing = [name for name in ("model_fn", "batch_fn") if name not in found]
    if missing:
        raise ValueError(f"lockstep doctor --dp-vs-ddp: {file} defines no {' or '.join(missing)}; "
                         f"{needs}")
    return found


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names the module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            if any(a.name == "*" for a in node.names):
                names.update(("model_fn", "batch_fn"))  # a star import may bring them
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # definitions under a guard
            names.update(_top_level_names(ast.Module(body=_blocks(node), type_ignores=[])))
    return names


def _blocks(node: ast.If | ast.Try | ast.With) -> list[ast.stmt]:
    body = list(node.body)
    if isinstance(node, (ast.If, ast.Try)):
        body += node.orelse
    if isinstance(node, ast.Try):
        body += [s for h in node.handlers for s in h.body] + node.finalbody
    return body
