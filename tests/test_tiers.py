"""The fast tier starts no process: a test without the multirank marker that tries fails loudly."""

from __future__ import annotations

import importlib

import pytest


def test_an_unmarked_test_cannot_start_a_process():
    # Reached through import_module so that the automatic marking (which looks for the name
    # in the test's code) does not mark this test: it must run unmarked to see the guard.
    run = importlib.import_module("subprocess").run
    with pytest.raises(RuntimeError, match="is not marked multirank"):
        run(["true"], check=True)
    start = importlib.import_module("multiprocessing").get_context("spawn").Process(target=print).start
    with pytest.raises(RuntimeError, match="is not marked multirank"):
        start()


def _starts_a_world():
    import lockstep

    return lockstep.spawn(print, 2)


def _calls_a_helper_that_starts_a_world():
    return _starts_a_world()


def _pure_logic():
    return sum(range(3))


def test_marking_follows_helpers(request):
    conftest = importlib.import_module("conftest")
    helpers = globals()  # looked up by name, so that this test itself is not marked
    assert conftest._starts_processes(helpers["_calls_a_helper_that_starts_a_world"], set())
    assert not conftest._starts_processes(helpers["_pure_logic"], set())
    assert request.node.get_closest_marker("multirank") is None
