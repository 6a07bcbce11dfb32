"""GradientArrivals (a world of one, or torch's DDP observed): the buckets DDP would send.

After the first backward fixes the layout, only each bucket's last-arriving parameter keeps a
hook, and the ready marks are the ones a hook on every parameter gave: the same buckets, in the
same order, named by the same last gradient.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep.ddp  # noqa: F401  # first: the known ddp <-> doctor import circle (tests/test_layers.py)
from lockstep.doctor.arrivals import GradientArrivals


class _Marks:
    """Stands in for the Recorder: keeps each bucket_ready call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None]] = []

    def bucket_ready(self, index: int, last_param: str | None = None) -> None:
        self.calls.append((index, last_param))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)], nn.Linear(32, 4))


def _counted_ready(net: nn.Module, cap: int) -> list[tuple[int, str]]:
    """The reference: a hook on every parameter, a bucket ready when all its members arrived."""
    named = [(n, p) for n, p in net.named_parameters()]
    arrivals = GradientArrivals([p for _, p in named], [n for n, _ in named], cap, _Marks())  # type: ignore[arg-type]
    net(torch.randn(3, 32)).sum().backward()
    buckets = [[named.index(next((n, p) for n, p in named if n == name)) for name in b["params"]]
               for b in arrivals.layout()]
    arrivals.remove()
    seen: list[int] = []
    hooks = []
    out: list[tuple[int, str]] = []

    def on_grad(i: int, _p: torch.Tensor) -> None:
        seen.append(i)
        for b, members in enumerate(buckets):
            if i in members and all(m in seen for m in members):
                out.append((b, named[i][0]))

    for i, (_, p) in enumerate(named):
        hooks.append(p.register_post_accumulate_grad_hook(lambda p, i=i: on_grad(i, p)))
    net(torch.randn(3, 32)).sum().backward()
    for h in hooks:
        h.remove()
    return out


def test_after_the_first_backward_one_hook_per_bucket_gives_the_same_marks():
    cap = 32 * 32 * 4 * 2 + 1  # about two layers a bucket: several buckets
    net = _net()
    named = list(net.named_parameters())
    marks = _Marks()
    arrivals = GradientArrivals([p for _, p in named], [n for n, _ in named], cap, marks)  # type: ignore[arg-type]
    assert arrivals.watched() == len(named) == 14
    net(torch.randn(3, 32)).sum().backward()
    assert marks.calls == []  # the first backward only learns the order
    layout = arrivals.layout()
    assert len(layout) > 2 and arrivals.watched() == len(layout)
    assert sorted(n for b in layout for n in b["params"]) == sorted(n for n, _ in named)
    for _ in range(3):
        marks.calls.clear()
        net(torch.randn(3, 32)).sum().backward()
        assert [b for b, _ in marks.calls] == list(range(len(layout)))  # each once, in launch order
    assert marks.calls == _counted_ready(_net(), cap)
    arrivals.remove()
    assert arrivals.watched() == 0
    marks.calls.clear()
    net(torch.randn(3, 32)).sum().backward()
    assert marks.calls == []


def test_a_parameter_without_a_gradient_in_the_first_backward_is_listed_not_watched():
    net = nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8)})
    named = list(net.named_parameters())
    marks = _Marks()
    arrivals = GradientArrivals([p for _, p in named], [n for n, _ in named], 1 << 20, marks)  # type: ignore[arg-type]
    net["used"](torch.randn(2, 8)).sum().backward()
    layout = arrivals.layout()
    assert sorted(n for b in layout for n in b["params"]) == sorted(n for n, _ in named)
    assert arrivals.watched() == 1  # one bucket, completed by the used layer's last gradient
    net["used"](torch.randn(2, 8)).sum().backward()
    assert marks.calls == [(0, marks.calls[0][1])] and marks.calls[0][1].startswith("used.")
