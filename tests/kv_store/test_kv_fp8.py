"""FP8 KV: the pool layout with scales, the store rule (power-of-two scales that grow, never
clip), and the C store's e4m3 rounding against torch's. The attention paths over fp8 are in
test_kv_8bit_paths.py."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.cpu_ops import decode_plan, load_cpu_ops
from kvmesh.shared.kv import kv_quant
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.rope import apply_rope

FP8 = torch.float8_e4m3fn
H_KV, D, BS = 2, 64, 4


# ---- layout -----------------------------------------------------------------------------------


def test_fp8_spec_keeps_scales_inside_each_head_span():
    fp32 = KVCacheSpec(3, 2, 8, 4, torch.float32)
    fp8 = KVCacheSpec(3, 2, 8, 4, FP8)
    assert fp32.block_bytes == 4 * fp32.bytes_per_token  # unchanged for float pools
    assert fp8.bytes_per_token * 4 == fp32.bytes_per_token
    assert fp8.head_bytes == 3 * 2 * 4 * 8 + 3 * 2 * 4  # data, then a float32 per (layer, K/V)
    assert fp8.block_bytes == 2 * fp8.head_bytes
    pool = KVPool(fp8, 3)
    pool.scales[1, 1, 2, 1] = 3.0  # block 1, head 1, layer 2, V
    changed = (pool.raw != 0).nonzero().flatten()
    start, length = pool.head_span(1, 1, 2)
    assert changed.numel() > 0 and bool(((changed >= start) & (changed < start + length)).all())


def test_fp8_spec_refuses_a_shape_whose_scales_cannot_align():
    with pytest.raises(ValueError, match="multiple of 4"):
        KVCacheSpec(1, 1, 3, 1, FP8)


def test_fingerprint_names_the_kv_dtype():
    assert KVCacheSpec(2, 2, 8, 4, FP8).fingerprint() != KVCacheSpec(2, 2, 8, 4).fingerprint()
    assert "float8_e4m3fn" in KVCacheSpec(2, 2, 8, 4, FP8).fingerprint()


# ---- the store rule -----------------------------------------------------------------------------


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
    amax = torch.cat(
        [torch.rand(1000) * 10 ** torch.randint(-3, 4, (1000,)), torch.tensor([448.0, 0.0])]
    )
    scale = kv_quant.pow2_scale(amax)
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all())  # powers of two
    assert bool((amax / scale <= kv_quant.FP8_MAX).all())
    fits_half = (amax / (scale / 2) <= kv_quant.FP8_MAX) & (scale / 2 >= kv_quant.MIN_SCALE)
    assert not bool(fits_half.any())


def test_quantize_saturates_instead_of_nan():
    x = torch.tensor([1e6, -1e6, 448.0, 464.0, -0.0])
    assert kv_quant.quantize(x).float().tolist() == [448.0, -448.0, 448.0, 448.0, -0.0]


def test_store_never_clips_as_a_block_fills_with_larger_tokens():
    data = torch.zeros(2, 8, 1, 16, dtype=FP8)  # (blocks, block_size, heads, D)
    scales = torch.zeros(2, 1)
    tokens = [torch.randn(1, 1, 16) * 4.0**i for i in range(8)]  # each one larger
    for i, x in enumerate(tokens):
        kv_quant.store(data, scales, x, torch.tensor([1]), torch.tensor([i]))
    stored = kv_quant.dequantize(data[1, :, 0], scales[1])  # (8, 16)
    scale = float(scales[1, 0])
    assert scale == float(kv_quant.pow2_scale(torch.cat(tokens).abs().max()))
    for i, x in enumerate(tokens):
        # within half a step of e4m3 at the tile's scale (steps are at most 32 * scale)
        assert (stored[i] - x.flatten()).abs().max() <= 16 * scale


def test_store_token_by_token_matches_one_write():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 16, generator=g) * torch.logspace(0, 2, 8)[:, None, None]
    blocks, offsets = torch.tensor([3] * 8), torch.arange(8)
    one = torch.zeros(4, 8, 2, 16, dtype=FP8), torch.zeros(4, 2)
    kv_quant.store(*one, x, blocks, offsets)
    each = torch.zeros(4, 8, 2, 16, dtype=FP8), torch.zeros(4, 2)
    for i in range(8):
        kv_quant.store(*each, x[i : i + 1], blocks[i : i + 1], offsets[i : i + 1])
    assert torch.equal(one[1], each[1])
    a, b = kv_quant.dequantize(one[0][3], one[1][3]), kv_quant.dequantize(each[0][3], each[1][3])
    # power-of-two rescaling is exact but below e4m3's subnormals: a step at most apart
    assert (a - b).abs().max() <= one[1][3].max() * 2.0**-9


def test_store_at_slot_zero_starts_the_block_afresh():
    data = torch.zeros(2, 4, 1, 8, dtype=FP8)
    scales = torch.full((2, 1), 1024.0)  # a stale scale of the block's previous owner
    x = torch.full((1, 1, 8), 0.5)
    kv_quant.store(data, scales, x, torch.tensor([1]), torch.tensor([0]))
    assert float(scales[1, 0]) == float(kv_quant.pow2_scale(torch.tensor(0.5)))
    assert torch.equal(kv_quant.dequantize(data[1, 0], scales[1]), x[0])


def test_move_token_across_blocks_requantizes_to_the_destination_scale():
    pool = KVPool(KVCacheSpec(2, 1, 8, 4, FP8), 3)
    data = pool.tensor.permute(0, 4, 1, 2, 3, 5)  # (N, bs, H, L, 2, D)
    small, large = torch.full((1, 1, 2, 2, 8), 0.25), torch.full((1, 1, 2, 2, 8), 100.0)
    kv_quant.store(data, pool.scales, large, torch.tensor([1]), torch.tensor([0]))
    kv_quant.store(data, pool.scales, small, torch.tensor([2]), torch.tensor([0]))
    source = kv_quant.dequantize(data[1, 0], pool.scales[1])  # 100 stored as 96
    small_scale = pool.scales[2].clone()
    kv_quant.move_token(pool.tensor, pool.scales, (1, 0), (2, 1))  # large into small's block
    assert bool((pool.scales[2] > small_scale).all())  # grown, not clipped
    assert torch.equal(kv_quant.dequantize(data[2, 1], pool.scales[2]), source)
    assert torch.equal(kv_quant.dequantize(data[2, 0], pool.scales[2]), small[0])


# ---- the C store against the torch one --------------------------------------------------------


def test_c_e4m3_rounding_matches_torch_on_ties_subnormals_and_the_edge():
    """Through a one-token store at scale 1 (a tile whose amax makes the scale exactly 1)."""
    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C compiler")
    values = [448.0, 1.0625, 1.1875, 0.0029296875, 0.0048828125, 2.0**-10, -0.0, 300.0, 17.0]
    x = torch.tensor(values + [0.0] * (D - len(values)))
    spec = KVCacheSpec(1, 1, D, BS, FP8)
    pools = [KVPool(spec, 2), KVPool(spec, 2)]
    qkv = torch.zeros(1, 3, D)
    qkv[0, 1], qkv[0, 2] = x, x
    cos, sin = torch.ones(1, 1, D), torch.zeros(1, 1, D)
    table, ctx = torch.tensor([[1]]), torch.tensor([1])
    k, v = pools[0].layer(0)
    plan = decode_plan(ctx, 1, BS, 1, quant_head_dim=D)
    ops.decode_attention(qkv, cos, sin, k, v, table, ctx, 1, 1.0, plan, pools[0].layer_scales(0))
    k, v = pools[1].layer(0)
    k_scales = pools[1].layer_scales(0)[0]
    rotated = apply_rope(x.view(1, 1, D), cos, sin)  # as the C store rotates it (-0.0 -> 0.0)
    kv_quant.store(k, k_scales, rotated, torch.tensor([1]), torch.tensor([0]))
    assert float(k_scales[1, 0]) == 1.0
    assert torch.equal(pools[0].layer(0)[0][1, 0].view(torch.uint8), k[1, 0].view(torch.uint8))
