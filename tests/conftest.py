"""Shared test fixtures.

Tiers: pure-logic tests run in this process; multi-rank tests go through ``lockstep.spawn``
(gloo on CPU, free port, a timeout so a bug fails instead of hanging); GPU tests carry
``@pytest.mark.gpu`` and are skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo  # noqa: F401  - imported by the first optimizer step; it sets TORCHINDUCTOR_CACHE_DIR
import torch.distributed as dist

# Multi-rank tests start many small worlds: fork them from a server that imported torch once
# instead of starting a fresh interpreter per rank (about 1.5 s of CPU each on this machine).
os.environ.setdefault("LOCKSTEP_START_METHOD", "forkserver")
# Multi-rank tests run gloo on CPU even on a GPU machine; GPU tests ask for CUDA explicitly.
os.environ.setdefault("LOCKSTEP_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
