"""INT8 KV: the pool layout with per-token group scales, the store rule, and the C store against
torch's, bit for bit. The attention paths over int8 are in test_kv_8bit_paths.py."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.cpu_ops import decode_plan, load_cpu_ops
from kvmesh.shared.kv import kv_int8
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.rope import apply_rope

INT8 = torch.int8
H_KV, D, BS = 2, 64, 4
G = D // kv_int8.GROUP


def outlier_values(n: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """(n, H_KV, D) values with a few large channels, as trained models' keys have."""
    x = scale * torch.randn(n, H_KV, D, generator=generator)
    x[:, :, 5] *= 30.0
    x[:, :, 40] *= -12.0
    return x


# ---- layout -----------------------------------------------------------------------------------


def test_int8_spec_keeps_each_tokens_scales_inside_its_head_span():
    fp32 = KVCacheSpec(3, 2, 64, 4, torch.float32)
    int8 = KVCacheSpec(3, 2, 64, 4, INT8)
    assert int8.bytes_per_token * 4 == fp32.bytes_per_token
    # data, then a float32 per (layer, K/V, token, 32 values): 36 bytes per 32 values
    assert int8.head_bytes == 3 * 2 * 4 * 64 + 3 * 2 * 4 * 2 * 4
    assert int8.head_bytes * 32 == 3 * 2 * 4 * 64 * 36
    assert int8.block_bytes == 2 * int8.head_bytes
    pool = KVPool(int8, 3)
    assert pool.scales.shape == (3, 2, 3, 2, 4, 2)
    pool.scales[1, 1, 2, 1, 3, 1] = 3.0  # block 1, head 1, layer 2, V, slot 3, values 32-63
    changed = (pool.raw != 0).nonzero().flatten()
    start, length = pool.head_span(1, 1, 2)
    assert changed.numel() > 0 and bool(((changed >= start) & (changed < start + length)).all())
    k_scales, v_scales = pool.layer_scales(2)
    assert k_scales.shape == (3, 4, 2, 2) and float(v_scales[1, 3, 1, 1]) == 3.0


def test_int8_spec_refuses_a_head_dim_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCacheSpec(1, 1, 48, 16, INT8)


def test_fingerprint_names_int8():
    spec = KVCacheSpec(2, 2, 32, 4, INT8)
    assert "int8" in spec.fingerprint()
    assert spec.fingerprint() != KVCacheSpec(2, 2, 32, 4, torch.float8_e4m3fn).fingerprint()


# ---- the store rule -----------------------------------------------------------------------------


def test_rotate_is_its_own_inverse_and_spreads_an_outlier_over_its_group():
    g = torch.Generator().manual_seed(2)
    x = outlier_values(5, g)
    torch.testing.assert_close(kv_int8.rotate(kv_int8.rotate(x)), x, rtol=1e-5, atol=1e-5)
    spike = torch.zeros(64)
    spike[5] = 32.0
    rotated = kv_int8.rotate(spike)
    assert torch.allclose(rotated[:32].abs(), torch.full((32,), 32.0 / 32**0.5))
    assert bool((rotated[32:] == 0).all())  # groups stay apart
    m = kv_int8.rotation_matrix(64)
    torch.testing.assert_close(x @ m, kv_int8.rotate(x), rtol=1e-5, atol=1e-5)


def test_quantize_maps_each_rotated_groups_largest_value_to_127_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    x = outlier_values(5, g)
    q, scales = kv_int8.quantize(x)
    assert q.dtype == INT8 and scales.shape == (5, H_KV, G)
    groups = kv_int8.rotate(x).unflatten(-1, (G, kv_int8.GROUP))
    assert torch.equal(scales, groups.abs().amax(-1) / 127.0)
    assert bool((q.unflatten(-1, (G, -1)).abs().amax(-1) == 127).all())
    rotated_err = (kv_int8.dequantize_rotated(q, scales) - kv_int8.rotate(x)).unflatten(-1, (G, -1))
    assert bool((rotated_err.abs().amax(-1) <= scales * 0.5 * (1 + 1e-5)).all())
    # rotated back, the error is no larger in sum of squares (an orthogonal map)
    err = kv_int8.dequantize(q, scales) - x
    assert float(err.square().sum()) <= float(rotated_err.square().sum()) * (1 + 1e-4)


def test_rotation_shrinks_the_error_of_a_group_with_an_outlier_channel():
    g = torch.Generator().manual_seed(3)
    x = outlier_values(64, g)
    q, scales = kv_int8.quantize(x)
    rotated = (kv_int8.dequantize(q, scales) - x).square().mean()
    groups = x.unflatten(-1, (G, kv_int8.GROUP))  # the same int8 rule without the rotation
    plain_scales = groups.abs().amax(-1, keepdim=True) / 127.0
    plain = (torch.round(groups / plain_scales) * plain_scales - groups).square().mean()
    assert float(rotated) < 0.5 * float(plain)


def test_quantize_leaves_an_all_zero_group_zero():
    x = torch.zeros(1, 64)
    x[0, 40] = 2.0
    q, scales = kv_int8.quantize(x)
    assert scales[0, 0] == 0 and bool((q[0, :32] == 0).all())
    torch.testing.assert_close(kv_int8.dequantize(q, scales), x, rtol=0, atol=2.0 / 127)


def test_store_token_by_token_matches_one_write():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 64, generator=g) * torch.logspace(0, 2, 8)[:, None, None]
    blocks, offsets = torch.tensor([3] * 8), torch.arange(8)
    one = torch.zeros(4, 8, 2, 64, dtype=INT8), torch.zeros(4, 8, 2, 2)
    kv_int8.store(*one, x, blocks, offsets)
    each = torch.zeros(4, 8, 2, 64, dtype=INT8), torch.zeros(4, 8, 2, 2)
    for i in range(8):
        kv_int8.store(*each, x[i : i + 1], blocks[i : i + 1], offsets[i : i + 1])
    assert torch.equal(one[0], each[0]) and torch.equal(one[1], each[1])


def test_move_token_carries_its_bytes_and_scales():
    pool = KVPool(KVCacheSpec(2, 1, 32, 4, INT8), 3)
    data = pool.tensor.permute(0, 4, 1, 2, 3, 5)  # (N, bs, H, L, 2, D)
    scales = pool.scales.permute(0, 4, 1, 2, 3, 5)
    large, small = torch.full((1, 1, 2, 2, 32), 100.0), torch.full((1, 1, 2, 2, 32), 0.25)
    kv_int8.store(data, scales, large, torch.tensor([1]), torch.tensor([0]))
    kv_int8.store(data, scales, small, torch.tensor([2]), torch.tensor([0]))
    before = kv_int8.dequantize(data[2, 0], scales[2, 0])
    kv_int8.move_token(pool.tensor, pool.scales, (1, 0), (2, 1))
    assert torch.equal(data[2, 1], data[1, 0]) and torch.equal(scales[2, 1], scales[1, 0])
    torch.testing.assert_close(kv_int8.dequantize(data[2, 1], scales[2, 1]), large[0])
    assert torch.equal(kv_int8.dequantize(data[2, 0], scales[2, 0]), before)  # untouched


# ---- the C store against the torch one --------------------------------------------------------


def test_c_int8_store_matches_torch_bit_for_bit_on_outliers_ties_and_zero_groups():
    """One token per slot through the C store and kv_int8.store: the same bytes and scales (the
    rotation's butterflies and the rounding run in the same order)."""
    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(8)
    tokens = [outlier_values(1, g)[0, 0], torch.zeros(D), torch.full((D,), 0.5)]
    tokens[1][40] = 3.0  # values 0-31: an all-zero group
    tokens.append(torch.arange(D, dtype=torch.float32) - 31.5)  # many exact halves
    spec = KVCacheSpec(1, 1, D, BS, INT8)
    pools = [KVPool(spec, 2), KVPool(spec, 2)]
    cos, sin = torch.ones(1, 1, D), torch.zeros(1, 1, D)  # no rotary turn
    table = torch.tensor([[1]])
    for i, x in enumerate(tokens):
        qkv = torch.zeros(1, 3, D)
        qkv[0, 1], qkv[0, 2] = x, -x
        ctx = torch.tensor([i + 1])
        k, v = pools[0].layer(0)
        plan = decode_plan(ctx, 1, BS, 1, quant_head_dim=D)
        scales = pools[0].layer_scales(0)
        ops.decode_attention(qkv, cos, sin, k, v, table, ctx, 1, 1.0, plan, scales)
        k, v = pools[1].layer(0)
        k_scales, v_scales = pools[1].layer_scales(0)
        slot = (torch.tensor([1]), torch.tensor([i]))
        kv_int8.store(k, k_scales, apply_rope(x.view(1, 1, D), cos, sin), *slot)
        kv_int8.store(v, v_scales, -x.view(1, 1, D), *slot)
    assert float(pools[1].layer_scales(0)[0][1, 1, 0, 0]) == 0.0  # the all-zero group
    assert torch.equal(pools[0].raw, pools[1].raw)
