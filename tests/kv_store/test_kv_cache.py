import pytest
import torch
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool


def test_bytes_per_token_follows_layout_math():
    spec = KVCacheSpec(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16
    )
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert spec.block_bytes == 16 * 128 * 1024  # 2 MiB


def test_block_is_one_contiguous_span_over_external_buffer():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    buf = bytearray(3 * spec.block_bytes)
    pool = KVPool(spec, 3, buffer=buf)
    k, v = pool.layer(1)
    k[2, 3, 1] = 7.0
    v[2, 0, 0] = 9.0
    raw = pool.block_bytes_view(2)
    floats = raw.view(torch.float32)
    assert floats.numel() == spec.block_bytes // 4
    assert (floats == 7.0).sum() == 4 and (floats == 9.0).sum() == 4
    assert pool.block_addr(2) == pool.base_addr + 2 * spec.block_bytes
    # the pool really is the handed-in memory
    assert (
        torch.frombuffer(buf, dtype=torch.float32)[2 * spec.block_bytes // 4 :].eq(7.0).sum() == 4
    )


def test_too_small_buffer_is_refused():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    with pytest.raises(ValueError, match="need"):
        KVPool(spec, 4, buffer=bytearray(spec.block_bytes))


def test_invalid_spec_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=0)


def test_head_range_of_a_block_is_one_contiguous_span():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=4, head_dim=2, block_size=2)
    pool = KVPool(spec, 2)
    for layer in range(3):
        k, v = pool.layer(layer)
        k[1, :, 2] = 5.0  # head 2 of block 1, every token
        v[1, :, 3] = 6.0
    start, length = pool.head_span(1, 2, 4)
    assert (start, length) == (spec.block_bytes + 2 * spec.head_bytes, 2 * spec.head_bytes)
    floats = pool.raw[start : start + length].view(torch.float32)
    assert (floats == 5.0).sum() == 3 * 2 * 2 and (floats == 6.0).sum() == 3 * 2 * 2
    assert (pool.raw.view(torch.float32) != 0).sum() == 24  # nothing outside the span
