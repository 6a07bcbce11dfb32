"""The public surface: every exported name resolves, unknown names fail clearly."""

from __future__ import annotations

import importlib

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
