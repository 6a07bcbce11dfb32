"""all_reduce_metrics and gather_for_eval when the ranks pass different things.

Until 2026-11-29 dicts in another order were summed name against wrong name, different names or
sizes were reduced silently (or left a rank waiting), and gather_for_eval exchanged only shapes:
another dtype read garbage or aborted gloo, another total cut the result at another length.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.helper import all_reduce_metrics, gather_for_eval
from lockstep.helper.collectives import _layout_differences


def test_layout_differences_name_ranks_and_metrics():
    said = _layout_differences([[("acc", 1), ("loss", 2)], [("loss", 3)], [("acc", 1), ("loss", 2)]])
    assert "metric 'acc' is passed by ranks 0, 2 but not by rank 1" in said
    assert "metric 'loss' has different numbers of elements: 2 on rank 0, 3 on rank 1, 2 on rank 2" in said
    assert _layout_differences([[("", 1)], [("acc", 1)]]) == (
        "the metric is passed by rank 0 but not by rank 1; "
        "metric 'acc' is passed by rank 1 but not by rank 0"
    )


def _error(call) -> str:
    try:
        call()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mismatches(rank: int) -> dict:
    lockstep.init_distributed()
    out: dict = {}
    # The same names in another order: each sums with its own name.
    mine = {"acc": 1.0, "loss": 10.0} if rank == 0 else {"loss": 20.0, "n": torch.tensor(2.0), "acc": 3.0}
    if rank == 0:
        mine["n"] = 0  # an int on one rank, a number of another kind elsewhere, is fine
    reduced = all_reduce_metrics(mine, op="sum")
    out["order"] = list(reduced)
    out["sums"] = {name: float(v) for name, v in reduced.items()}
    out["keys"] = _error(lambda: all_reduce_metrics({"acc": 0.9} if rank == 0 else {"loss": 5.0}))
    out["sizes"] = _error(lambda: all_reduce_metrics({"acc": torch.ones(2 + rank * 28)}))
    out["bare"] = _error(lambda: all_reduce_metrics(1.0 if rank == 0 else {"acc": 1.0}))
    out["after"] = all_reduce_metrics(torch.tensor([rank, 1.0])).tolist()  # the group still works

    rows = torch.arange(3).reshape(3, 1) * 2 + rank
    out["dtype"] = _error(lambda: gather_for_eval(rows.to(torch.float32 if rank == 0 else torch.float64), 5))
    out["total"] = _error(lambda: gather_for_eval(rows, 5 if rank == 0 else 6))
    out["bad_total"] = _error(lambda: gather_for_eval(rows, 5 if rank == 0 else None))
    out["shape"] = _error(lambda: gather_for_eval(rows[: 2 + rank], 4))
    out["gathered"] = gather_for_eval(rows, list(range(5))).flatten().tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.multirank
def test_ranks_that_disagree_get_the_same_error_and_the_right_sums():
    results = lockstep.spawn(_mismatches, 2, timeout=120)
    assert results[0]["order"] == ["acc", "loss", "n"]
    assert results[1]["order"] == ["loss", "n", "acc"]
    for out in results:
        assert out["sums"] == {"acc": 4.0, "loss": 30.0, "n": 2.0}
        assert out["keys"] == (
            "ValueError: all_reduce_metrics needs the same metrics, of the same sizes, on every "
            "rank: metric 'acc' is passed by rank 0 but not by rank 1; metric 'loss' is passed by "
            "rank 1 but not by rank 0. Pass the same names, each with the same number of elements, "
            "on every rank (a rank without data passes 0, or zeros of the same size)"
        )
        assert "metric 'acc' has different numbers of elements: 2 on rank 0, 30 on rank 1" in out["sizes"]
        assert "the metric is passed by rank 0 but not by rank 1" in out["bare"]
        assert out["after"] == [0.5, 1.0]
        assert out["dtype"].startswith(
            "ValueError: gather_for_eval needs the same dtype on every rank, got "
            "['float32', 'float64'] by rank"
        )
        assert out["total"].startswith(
            "ValueError: gather_for_eval needs the same total on every rank, got [5, 6] by rank"
        )
        assert out["bad_total"].startswith(
            "TypeError: gather_for_eval's total is a NoneType, not a dataset or a number of "
            "samples on rank 1"
        )
        assert "same shape on every rank, got [(2, 1), (3, 1)] by rank" in out["shape"]
        assert out["gathered"] == [0, 1, 2, 3, 4]
