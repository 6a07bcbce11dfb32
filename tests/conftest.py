"""Shared test fixtures and the test tiers.

- Pure-logic tests run in this process and start no process: ``pytest -m "not multirank"``.
- Tests that start processes (ranks through ``lockstep.spawn``, gloo on CPU, a free port and a
  timeout; launcher jobs and scripts through ``subprocess``) carry the ``multirank`` marker:
  ``pytest -m multirank``. The marker is added automatically to every test whose code, helpers
  or fixtures (within tests/) use ``spawn``, ``subprocess`` or ``multiprocessing``; a test that
  starts a process some other way must carry ``@pytest.mark.multirank`` itself, and fails
  loudly if it does not (see ``_processes_only_in_multirank``).
- Tests that stand several launchers on this host in for several machines carry
  ``@pytest.mark.multimachine`` (and ``multirank``): ``pytest -m multimachine``.
- GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA.
- Long scenarios (a second variant of a SIGKILL resume, a second multi-machine case, the GPU
  acceptance dry run, the slowest doctor and docs commands) carry ``@pytest.mark.slow``: they
  are skipped unless the ``-m`` expression names ``slow`` (``pytest -m slow`` runs them; CI
  runs both). Each feature keeps at least one test in the default run.
"""

from __future__ import annotations

import _posixsubprocess
import inspect
import multiprocessing.process
import os
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # imported by the first optimizer step; it sets TORCHINDUCTOR_CACHE_DIR
import torch.distributed as dist

# Multi-rank tests start many small worlds: fork them from a server that imported torch once
# instead of starting a fresh interpreter per rank (about 1.5 s of CPU each on this machine).
os.environ.setdefault("LOCKSTEP_START_METHOD", "forkserver")
# Multi-rank tests run gloo on CPU even on a GPU machine; GPU tests ask for CUDA explicitly.
os.environ.setdefault("LOCKSTEP_DEVICE", "cpu")


TESTS_DIR = Path(__file__).resolve().parent
# Names (or keyword arguments: a DataLoader's num_workers) whose use in a test's code means
# that it starts processes.
PROCESS_NAMES = frozenset(
    {"spawn", "subprocess", "Popen", "multiprocessing", "start_processes", "num_workers"}
)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
        elif isinstance(const, tuple):  # keyword argument names of a call
            names |= {c for c in const if isinstance(c, str)}
    return names


def _starts_processes(obj: Any, seen: set[int]) -> bool:
    """Whether ``obj`` (a function or class defined under tests/) names a process-starting API,
    directly or through the test helpers it calls."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, type):
        return any(_starts_processes(v, seen) for v in vars(obj).values() if inspect.isfunction(v))
    code = getattr(obj, "__code__", None)
    if code is None or not Path(code.co_filename).resolve().is_relative_to(TESTS_DIR):
        return False
    names = _code_names(code)
    if names & PROCESS_NAMES:
        return True
    helpers = getattr(obj, "__globals__", {})
    return any(
        _starts_processes(helpers[name], seen)
        for name in names
        if name in helpers and (inspect.isfunction(helpers[name]) or inspect.isclass(helpers[name]))
    )


def _needs_multirank(item: pytest.Item) -> bool:
    seen: set[int] = set()
    if _starts_processes(getattr(item, "obj", None), seen):
        return True
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(
        _starts_processes(d.func, seen)
        for defs in fixtures.values()
        for d in defs
        if d.argname != "_processes_only_in_multirank"  # it names them to patch them
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multirank") is None and _needs_multirank(item):
            item.add_marker(pytest.mark.multirank)
    if "slow" not in (config.getoption("markexpr") or ""):
        later = pytest.mark.skip(reason="a long scenario: python -m pytest -q -m slow")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(later)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    """Let matplotlib build its font cache (it runs ``fc-list`` once per machine) before any
    test: a fast-tier test that draws a picture must not be the one that starts that process."""
    try:
        import matplotlib.font_manager  # noqa: F401  (builds or loads the cache)
    except ImportError:
        pass  # optional: the commands that draw skip the picture


@pytest.fixture(autouse=True)
def _processes_only_in_multirank(request):
    """Fail a test without the ``multirank`` marker that starts a process, so that
    ``pytest -m "not multirank"`` stays a tier that starts none."""
    if request.node.get_closest_marker("multirank") is not None:
        yield
        return

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{request.node.nodeid} started a process but is not marked multirank: "
            "add @pytest.mark.multirank to it (the fast tier, -m 'not multirank', starts none)"
        )

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in [
            # (os.system is left alone: a test pickles it to check it never runs)
            (os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"),
            (_posixsubprocess, "fork_exec"), (subprocess.Popen, "_execute_child"),
            (multiprocessing.process.BaseProcess, "start"),
        ]:
            if hasattr(owner, name):
                patch.setattr(owner, name, refuse)
        yield


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves a process group or changed environment variables behind."""
    before = dict(os.environ)
    yield
    leaked_group = dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    after = dict(os.environ)
    changed = sorted(
        k for k in set(before) | set(after)
        if before.get(k) != after.get(k) and k != "PYTEST_CURRENT_TEST"
    )
    os.environ.clear()
    os.environ.update(before)
    assert not leaked_group, "test left the default process group initialised"
    assert not changed, f"test changed environment variables: {changed}"


@pytest.fixture
def world_of_one():
    """A world of one gloo rank in this process (shared by the files that need one)."""
    import lockstep

    info = lockstep.init_distributed(device="cpu")
    try:
        yield info
    finally:
        lockstep.shutdown_distributed()
