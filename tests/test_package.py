"""The public surface: every exported name resolves, unknown names fail clearly."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import lockstep


@pytest.mark.parametrize("name", sorted(lockstep._EXPORTS))
def test_every_export_resolves(name):
    value = getattr(lockstep, name)
    assert getattr(importlib.import_module(lockstep._EXPORTS[name]), name) is value


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'DistributedDataparallel'"):
        lockstep.DistributedDataparallel  # noqa: B018 - a typo users make


def test_cli_entry_point_is_declared():
    from lockstep.cli import main

    assert callable(main)


def test_every_submodule_is_reachable_as_an_attribute():
    found = {m.name for m in pkgutil.iter_modules(lockstep.__path__) if not m.name.startswith("_")}
    assert set(lockstep._submodules()) == found
    for name in found:
        assert getattr(lockstep, name) is importlib.import_module(f"lockstep.{name}")
        assert name in dir(lockstep)


def _subpackages() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(lockstep.__path__) if m.ispkg)


@pytest.mark.parametrize("package", _subpackages())
def test_every_subpackage_exports_its_public_names(package):
    module = importlib.import_module(f"lockstep.{package}")
    assert module.__all__, f"lockstep.{package} exports nothing: list its public names in __all__"
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_top_level_names_are_also_exported_by_their_subpackage():
    """`from lockstep.zero import ZeroRedundancyOptimizer` works as `from lockstep.ddp import ...` does."""
    for name, where in lockstep._EXPORTS.items():
        parts = where.split(".")
        if len(parts) > 2:  # defined inside a subpackage: lockstep.<package>.<module>
            package = importlib.import_module(".".join(parts[:2]))
            assert name in package.__all__, f"{name} is not exported by {package.__name__}"


@pytest.mark.timeout(60)
def test_import_is_cheap_and_submodules_load_on_access():
    code = (
        "import sys, lockstep\n"
        "assert 'torch' not in sys.modules, 'import lockstep imported torch'\n"
        "lockstep.helper.ShardedLoader, lockstep.comm.uncompressed_hook\n"
        "lockstep.diagnose.collective_checks.debug_collectives_enabled\n"
        "from lockstep.zero import ZeroRedundancyOptimizer\n"
        "import lockstep.launcher.worker\n"
        "assert 'lockstep.launcher.run' not in sys.modules, 'a worker loaded the launcher'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
