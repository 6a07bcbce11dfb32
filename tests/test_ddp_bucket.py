"""Bucket assignment and buffers: pure logic, no processes."""

from __future__ import annotations

import pytest
import torch

from lockstep.ddp.bucket import MB, Bucket, BucketSpec, assign_buckets

F32 = (torch.float32, torch.device("cpu"))
F64 = (torch.float64, torch.device("cpu"))


def spec(numel: int, key=F32) -> BucketSpec:
    return BucketSpec(numel, 4 if key == F32 else 8, key)


def test_small_first_bucket_then_cap():
    specs = [spec(MB // 32)] * 10  # 128 KB each: 8 of them make the 1 MB first bucket
    buckets = assign_buckets(specs, list(range(10)), cap_bytes=2 * MB)
    assert [len(b) for b in buckets] == [8, 2]


def test_reverse_order_is_kept_within_and_across_buckets():
    specs = [spec(100)] * 6
    order = list(reversed(range(6)))
    buckets = assign_buckets(specs, order, cap_bytes=800, first_cap_bytes=800)
    assert buckets == [[5, 4], [3, 2], [1, 0]]


def test_parameter_larger_than_cap_gets_its_own_bucket():
    specs = [spec(10), spec(10_000), spec(10)]
    buckets = assign_buckets(specs, [2, 1, 0], cap_bytes=1000, first_cap_bytes=1000)
    assert buckets == [[2, 1], [0]]


def test_dtypes_never_share_a_bucket():
    specs = [spec(10), spec(10, F64), spec(10), spec(10, F64)]
    buckets = assign_buckets(specs, [3, 2, 1, 0], cap_bytes=MB)
    assert buckets == [[3, 1], [2, 0]]
    assert all(len({specs[i].key for i in b}) == 1 for b in buckets)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        assign_buckets([spec(1)], [0], cap_bytes=0)
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets([spec(1), spec(1)], [0, 0], cap_bytes=10)


def test_bucket_views_alias_one_flat_buffer():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    bucket = Bucket.allocate(0, [1, 0], params)
    assert bucket.buffer.numel() == 17 and bucket.offsets == [0, 5]
    bucket.views[1].fill_(2.0)
    assert bucket.buffer[5:].eq(2.0).all() and bucket.views[1].shape == (3, 4)
    assert bucket.nbytes == 17 * 4


def _layouts_against_torch(rank: int) -> dict:
    """A channels_last convolution, with and without gradient views, and a sub-byte bucket cap,
    under torch's DDP and lockstep's: gradient strides and final weights."""
    import lockstep

    lockstep.init_distributed()
    out = {}
    for name, kwargs in {"views": {"gradient_as_bucket_view": True}, "copies": {},
                         "tiny_cap": {"bucket_cap_mb": 1e-9}}.items():
        runs = []
        for cls in (torch.nn.parallel.DistributedDataParallel, lockstep.DistributedDataParallel):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2))
            net = net.to(memory_format=torch.channels_last)
            model = cls(net, **kwargs)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(2):
                x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step * 2 + rank))
                opt.zero_grad()
                model(x.to(memory_format=torch.channels_last)).square().mean().backward()
                strides = [tuple(p.grad.stride()) for p in model.parameters()]
                opt.step()
            runs.append(([p.detach().clone() for p in model.parameters()], strides))
        (theirs, s_t), (ours, s_o) = runs
        out[name] = (all(torch.equal(a, b) for a, b in zip(theirs, ours)), s_t, s_o)
    return out


@pytest.mark.multirank
def test_gradients_keep_the_parameters_layout_and_a_sub_byte_cap_is_a_bucket_each_as_torch():
    import lockstep

    for result in lockstep.spawn(_layouts_against_torch, 2, timeout=120):
        for name, (equal, theirs, ours) in result.items():
            assert equal, name
            assert ours == theirs, (name, ours, theirs)  # channels_last: (27, 1, 9, 3)
