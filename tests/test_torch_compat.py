"""Every torch private lockstep uses exists on this torch and does what lockstep relies on; a
missing one fails with TorchCompatError naming the torch version.

Run this file under the oldest supported torch (lockstep._torch_compat.OLDEST_TORCH) as well as
the pinned one: ``pip install torch==2.4.* && python -m pytest -q tests/test_torch_compat.py``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep import _torch_compat as compat
from lockstep._torch_compat_compile import compile_backend_in_effect, compiled_module_backend


def test_queue_callback_runs_when_backward_ends():
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad: torch.Tensor) -> None:
        order.append("hook")
        compat.queue_callback(lambda: order.append("end"))

    y.register_hook(hook)
    y.sum().backward()
    assert order == ["hook", "end"]


def test_current_graph_task_id_inside_and_outside_backward():
    seen: list[int] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(compat.current_graph_task_id()))
    y.sum().backward()
    assert compat.current_graph_task_id() == -1
    assert seen and seen[0] >= 0


def test_preserve_version_counter_keeps_the_version():
    t = torch.zeros(3)
    before = t._version
    with compat.preserve_version_counter([t]):
        t.add_(1)
    assert t._version == before
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(3)
    before = compat.tensor_version(t)
    t.add_(1)
    view = t.detach()  # a detached view shares the counter: what a state_dict() holds
    view.mul_(2)
    assert compat.tensor_version(t) == compat.tensor_version(view) == before + 2
    with compat.preserve_version_counter([t]):
        t.add_(1)
    assert compat.tensor_version(t) == before + 2


def test_flatten_and_unflatten_round_trip():
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = compat.flatten_dense_tensors(tensors)
    assert flat.numel() == 7
    back = compat.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_copy_tensors_copies_every_pair(monkeypatch, foreach):
    if foreach:
        assert hasattr(torch, "_foreach_copy_")  # the one-call path exists on this torch
    else:
        monkeypatch.delattr(torch, "_foreach_copy_")  # an older torch: the loop
    sources = [torch.randn(3, 4).t(), torch.arange(5), torch.tensor(2.5), torch.empty(0)]
    buffers = [torch.empty(4, 3), torch.empty(5, dtype=torch.int64), torch.empty(()), torch.empty(0)]
    compat.copy_tensors(buffers, sources)
    assert all(torch.equal(b, s) for b, s in zip(buffers, sources))


def test_optimizer_state_dict_hooks_in_registration_order():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    calls: list[str] = []
    optimizer.register_state_dict_pre_hook(lambda o: calls.append("save_pre"))
    optimizer.register_state_dict_post_hook(lambda o, sd: calls.append("save_post"))
    optimizer.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    optimizer.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    hooks = compat.optimizer_state_dict_hooks(optimizer)
    for hook in hooks.save_pre + hooks.load_post:
        hook(optimizer)
    for hook in hooks.save_post + hooks.load_pre:
        hook(optimizer, {})
    assert calls == ["save_pre", "load_post", "save_post", "load_pre"]


def test_refresh_rnn_flat_weights_points_at_the_clone_parameters():
    lstm = nn.LSTM(3, 4)
    clone = copy.copy(lstm)
    clone._parameters = {k: nn.Parameter(v.detach().clone()) for k, v in lstm._parameters.items()}
    compat.refresh_rnn_flat_weights(clone)
    assert all(a is clone._parameters[n] for a, n in zip(clone._flat_weights,
                                                          clone._flat_weights_names))
    compat.refresh_rnn_flat_weights(nn.Linear(2, 2))  # not an RNN: nothing to do


def test_default_store_none_without_group_and_the_store_with_one():
    assert compat.default_store() is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = compat.default_store()
        store.set("lockstep/compat", "ok")
        assert store.get("lockstep/compat") == b"ok"
    finally:
        dist.destroy_process_group()


def test_compile_backends():
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    backend, original = compiled_module_backend(compiled)
    assert callable(backend) and isinstance(original, nn.Linear)
    assert compiled_module_backend(nn.Linear(2, 2)) is None
    assert compile_backend_in_effect() is None  # eager


def test_rendezvous_internals_on_a_real_handler():
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    store = dist.HashStore()
    handler = DynamicRendezvousHandler.from_backend(
        "compat", store, C10dRendezvousBackend(store, "compat"), min_nodes=1, max_nodes=1)
    internals = compat.rendezvous_internals(handler)
    assert internals.settings.run_id == "compat"
    assert internals.store is not None and internals.this_node is not None
    assert internals.state.round == 0
    compat.forget_shared_store_server(handler)


def _one_node_handler(cls, run_id: str):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    store = dist.HashStore()
    return cls.from_backend(run_id, store, C10dRendezvousBackend(store, run_id),
                            min_nodes=1, max_nodes=1, local_addr="127.0.0.1")


def test_rendezvous_internals_follow_the_rounds():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    handler = _one_node_handler(DynamicRendezvousHandler, "rounds")
    try:
        assert not compat.rendezvous_internals(handler).state.complete
        handler.next_rendezvous()
        internals = compat.rendezvous_internals(handler)
        assert internals.state.complete  # read afresh: the round just completed
        assert list(internals.state.participants) == [internals.this_node]
        internals.store.set("lockstep/compat", "ok")
        assert internals.store.get("lockstep/compat") == b"ok"
    finally:
        handler.shutdown()


def test_forget_shared_store_server_clears_the_cache(monkeypatch):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    handler = _one_node_handler(DynamicRendezvousHandler, "forget")
    handler._shared_tcp_store_server, handler._bootstrap_store_info = object(), object()
    compat.forget_shared_store_server(handler)
    assert handler._shared_tcp_store_server is None and handler._bootstrap_store_info is None
    # A torch whose handler hosts no store for its workers keeps nothing to forget.
    monkeypatch.delattr(DynamicRendezvousHandler, "_create_tcp_store_server")
    compat.forget_shared_store_server(object())


def test_workers_store_override_is_what_torch_calls(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    asked: list[tuple[str, int]] = []

    class Handler(compat.WorkersStoreOverride, DynamicRendezvousHandler):
        def workers_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
            asked.append((master_addr, master_port))
            return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    handler = _one_node_handler(Handler, "override")
    try:
        info = handler.next_rendezvous()  # rank 0 of one: hosts the workers' store
        assert asked == [("127.0.0.1", 0)]
        assert info.bootstrap_store_info.master_port == handler._shared_tcp_store_server.port
        # The older call form: one RendezvousStoreInfo.
        handler._create_tcp_store_server(RendezvousStoreInfo("127.0.0.1", 0))
        assert asked[-1] == ("127.0.0.1", 0) and len(asked) == 2
    finally:
        handler.shutdown()
    with pytest.raises(NotImplementedError):
        compat.WorkersStoreOverride().workers_store_server("127.0.0.1", 0)


def test_batch_norm_base_is_torchs():
    assert isinstance(nn.BatchNorm1d(3), compat.BatchNormBase)


@pytest.mark.parametrize("call", [
    lambda: compat.current_graph_task_id(),
    lambda: compat.queue_callback(lambda: None),
])
def test_a_missing_private_names_the_torch_version(monkeypatch, call):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    with pytest.raises(compat.TorchCompatError, match=re.escape(f"torch {torch.__version__} has no")):
        call()


def test_missing_rendezvous_internals_name_the_torch_version():
    with pytest.raises(compat.TorchCompatError, match=re.escape(f"torch {torch.__version__}")):
        compat.rendezvous_internals(object())
    with pytest.raises(compat.TorchCompatError, match="_shared_tcp_store_server"):
        compat.forget_shared_store_server(object())


def test_loader_iterator_position_names():
    from torch.utils.data import DataLoader

    from lockstep._torch_compat import (
        is_loader_iterator,
        loader_batches_yielded,
        loader_index_sampler,
    )

    loader = DataLoader(list(range(10)), batch_size=3)
    it = iter(loader)
    assert is_loader_iterator(it) and not is_loader_iterator(loader)
    next(it)
    assert loader_batches_yielded(vars(it)) == 1
    assert loader_index_sampler(vars(it)) is loader.batch_sampler
