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
