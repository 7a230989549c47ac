"""Writes between KV pools of different dtypes: the prefill rank converts into staging in the
decode's layout (fp8 or int8 with scales, or float), the entries carry the destination's bytes."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.kv_convert import pack_converted
from kvmesh.services.prefill.kv_writes import (
    KVDestination,
    KVLayoutError,
    plan_kv_writes,
    run_packs,
    staging_bytes,
)
from kvmesh.shared.kv import kv_int8, kv_quant
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport.base import MemoryRegion

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
HEADS = 4
D = 32  # one int8 scale group


def _spec(heads: int, dtype: torch.dtype, block_size: int = 4) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=2, num_kv_heads=heads, head_dim=D, block_size=block_size, dtype=dtype
    )


def _source(spec: KVCacheSpec, num_blocks: int) -> tuple[KVPool, MemoryRegion]:
    pool = KVPool(spec, num_blocks)
    g = torch.Generator().manual_seed(1)
    values = torch.randn(pool.tensor.shape, generator=g) * 3
    if spec.is_fp8:  # through the store rule, one (block, head) tile at a time
        data = pool.tensor.permute(0, 4, 1, 2, 3, 5)  # (N, bs, H, L, 2, D)
        for b in range(num_blocks):
            tokens = values[b].permute(3, 0, 1, 2, 4)  # (bs, H, L, 2, D)
            slots = torch.arange(spec.block_size)
            kv_quant.store(data, pool.scales, tokens, torch.full_like(slots, b), slots)
    elif spec.is_int8:
        pool.tensor.copy_(kv_int8.quantize(values)[0])
        pool.scales.copy_(kv_int8.quantize(values)[1])
    else:
        pool.tensor.copy_(values)
    return pool, MemoryRegion(pool.base_addr, pool.nbytes, rkey=3)


def _values(pool: KVPool) -> torch.Tensor:
    """(N, H, L, 2, bs, D) float32 values the pool holds."""
    if pool.scales is None:
        return pool.tensor.float()
    if pool.spec.is_int8:
        return kv_int8.dequantize(pool.tensor, pool.scales)
    return pool.tensor.float() * pool.scales[..., None, None]


def _apply(plan, staging: torch.Tensor, dst: KVPool) -> None:
    for entries in plan.writes:
        for e in entries:
            start = e.remote_addr - dst.base_addr
            dst.raw[start : start + e.length] = staging[e.local_offset : e.local_offset + e.length]


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "src_tp"),
    [
        (torch.float32, FP8, 1),
        (torch.bfloat16, FP8, 1),
        (FP8, torch.float32, 1),
        (torch.float32, FP8, 2),
        (FP8, torch.float16, 2),
        (torch.float32, INT8, 1),
        (INT8, torch.float32, 1),
        (torch.float32, INT8, 2),
        (INT8, FP8, 1),
        (FP8, INT8, 2),
    ],
)
def test_converted_writes_carry_the_values_in_the_decode_dtype(src_dtype, dst_dtype, src_tp):
    heads = HEADS // src_tp
    dst = KVPool(_spec(HEADS, dst_dtype), 6)
    src_ids, dst_ids = [3, 0, 2], [1, 4, 5]
    expected = torch.zeros(3, HEADS, 2, 2, 4, D)
    for rank in range(src_tp):
        pool, region = _source(_spec(heads, src_dtype), 4)
        dest = KVDestination(dst.spec, 9, tuple(dst.block_addr(b) for b in dst_ids))
        need = staging_bytes(pool.spec, 3, [dest], src_rank=rank, src_tp=src_tp)
        assert need == 3 * heads * dst.spec.head_bytes  # the decode's bytes, not the prefill's
        staging = torch.zeros(need, dtype=torch.uint8)
        sreg = MemoryRegion(staging.data_ptr(), need, rkey=4)
        plan = plan_kv_writes(
            pool, region, src_ids, [dest], src_rank=rank, src_tp=src_tp, staging=sreg
        )
        assert plan.num_bytes == need
        run_packs(plan, pool, staging)
        _apply(plan, staging, dst)
        expected[:, rank * heads : (rank + 1) * heads] = _values(pool)[src_ids]
    got = _values(dst)[dst_ids]
    if dst_dtype == FP8:  # within half an e4m3 step of each tile's scale
        step = dst.scales[dst_ids][..., None, None] * 16
        assert bool(((got - expected).abs() <= step).all())
    elif dst_dtype == INT8:  # rotated, within half a step of each token's group scale
        step = dst.scales[dst_ids].repeat_interleave(kv_int8.GROUP, -1) * 0.5 * (1 + 1e-4)
        err = kv_int8.rotate(got) - kv_int8.rotate(expected)
        assert bool((err.abs() <= step + 1e-5).all())
    else:
        assert torch.allclose(got, expected, rtol=2**-8 if dst_dtype != torch.float32 else 0)


def test_int8_destination_takes_a_quarter_of_float32_bytes_plus_a_scale_per_32_values():
    fp32, int8 = _spec(HEADS, torch.float32, 16), _spec(HEADS, INT8, 16)
    assert int8.bytes_per_token * 4 == fp32.bytes_per_token
    assert int8.block_bytes * 32 == fp32.block_bytes // 4 * 36


def test_pack_converted_from_int8_to_int8_keeps_the_bytes():
    pool, _ = _source(_spec(2, INT8), 3)
    out = pack_converted(pool.tensor, pool.scales, [2, 1], 0, 2, INT8)
    dst = KVPool(_spec(2, INT8), 2)
    dst.raw.copy_(out.flatten())
    assert torch.equal(dst.raw, torch.cat([pool.block_bytes_view(2), pool.block_bytes_view(1)]))


def test_fp8_destination_takes_a_quarter_of_float32_bytes_plus_scales():
    fp32, fp8 = _spec(HEADS, torch.float32, 16), _spec(HEADS, FP8, 16)
    assert fp8.bytes_per_token * 4 == fp32.bytes_per_token
    assert fp8.block_bytes == fp32.block_bytes // 4 + HEADS * fp8.scale_bytes


def test_pack_converted_zeroes_and_ignores_tokens_past_the_run():
    pool, _ = _source(_spec(1, torch.float32), 2)
    pool.tensor[1, :, :, :, 2:] = 1000.0  # stale slots past a 6-token run
    out = pack_converted(pool.tensor, None, [0, 1], 0, 1, FP8, num_tokens=6)
    dst = KVPool(_spec(1, FP8), 2)
    dst.raw.copy_(out.flatten())
    assert float(dst.scales[1].max()) < 1.0  # the stale 1000s did not set the scale
    assert bool((dst.tensor[1, :, :, :, 2:].float() == 0).all())


def test_pack_converted_from_fp8_to_fp8_keeps_the_values():
    pool, _ = _source(_spec(2, FP8), 3)
    out = pack_converted(pool.tensor, pool.scales, [2, 1], 0, 2, FP8)
    dst = KVPool(_spec(2, FP8), 2)
    dst.raw.copy_(out.flatten())
    assert torch.equal(_values(dst), _values(pool)[[2, 1]])


def test_fp8_with_another_block_size_is_refused():
    pool, region = _source(_spec(HEADS, torch.float32, 4), 2)
    dest = KVDestination(_spec(HEADS, FP8, 8), 1, (0,))
    with pytest.raises(KVLayoutError, match="not both"):
        plan_kv_writes(pool, region, [0, 1], [dest])
    pool8, region8 = _source(_spec(HEADS, FP8, 4), 2)
    with pytest.raises(KVLayoutError, match="fp8 and int8 blocks"):
        plan_kv_writes(pool8, region8, [0, 1], [KVDestination(_spec(HEADS, FP8, 8), 1, (0,))])


def test_conversion_without_staging_is_refused_with_the_bytes_it_needs():
    pool, region = _source(_spec(HEADS, torch.float32), 2)
    dest = KVDestination(_spec(HEADS, FP8), 1, (0, 1))
    with pytest.raises(KVLayoutError, match=r"converted through a registered staging region"):
        plan_kv_writes(pool, region, [0, 1], [dest])


def test_prefill_converts_for_a_decode_spec_that_differs_in_the_kv_dtype_alone():
    from kvmesh.services.prefill.convert import decode_kv_dtype
    from kvmesh.services.prefill.plan import KVSpecMismatchError

    fp32 = "L2-H1-D32-B16-float32:model-ab12"
    fp8 = "L2-H1-D32-B16-float8_e4m3fn:model-ab12"
    assert decode_kv_dtype(fp32, fp32) is None
    assert decode_kv_dtype(fp32, fp8) == FP8 and decode_kv_dtype(fp8, fp32) == torch.float32
    for other in (
        "L2-H1-D32-B8-float8_e4m3fn:model-ab12",
        "L2-H1-D32-B16-float8_e4m3fn:model-cd34",
    ):
        with pytest.raises(KVSpecMismatchError, match="same model and block size"):
            decode_kv_dtype(fp32, other)
    with pytest.raises(KVSpecMismatchError, match="no conversion"):
        decode_kv_dtype(fp32, "L2-H1-D32-B16-int16:model-ab12")
    assert decode_kv_dtype(fp32, "L2-H1-D32-B16-int8:model-ab12") == INT8
