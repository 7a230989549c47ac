"""``make gpu-check``'s kernel benchmarks, each against torch in the same run:

* ``bench_kv_pack``: the KV pack and scatter kernels (kernels/kv_pack.py) moving a TP half of the
  heads of scattered blocks, in GB/s, against ``torch`` copying the same bytes device to device
  (goal: ratio >= 0.8).
* ``bench_paged_decode``: the paged decode attention kernel (kernels/paged_attention.py) against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same keys and values laid out
  unpaged, per batch size (goal: ratio >= 1.0 at batch 32 and up).
* ``bench_quant_matmul``: the quantized matmul (kernels/quant_matmul.py) over a weight kept as
  stored, per format and row count, against the path it replaces (``QuantLinear``: dequantize,
  then ``F.linear``) and against ``F.linear`` over the weight already dequantized to the
  activations' dtype (what a float model reads); the weight's GB/s at each (goal: faster than
  dequantize-then-matmul at one row, every format).
"""

from __future__ import annotations

from typing import Any

import torch
from kvmesh.loadgen.device_timing import ratio, time_fn
from kvmesh.loadgen.gpu_sizes import BenchSizes

GOAL_PACK_RATIO = 0.8
GOAL_QUANT_DECODE_RATIO = 1.0  # dequantize-then-matmul time / kernel time, one row of x
GOAL_ATTENTION_RATIO = 1.0  # at batch >= ATTENTION_GOAL_MIN_BATCH
ATTENTION_GOAL_MIN_BATCH = 32


def bench_kv_pack(sizes: BenchSizes, device: torch.device) -> dict[str, Any]:
    """GB/s of pack_blocks and scatter_blocks moving heads [0, H/2) of ``pack_blocks`` scattered
    blocks, against ``torch`` copying a contiguous tensor of the same bytes on the same device."""
    from kvmesh.kernels.kv_pack import pack_blocks, pack_blocks_ref, scatter_blocks
    from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool

    spec = KVCacheSpec(
        num_layers=sizes.layers,
        num_kv_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        block_size=sizes.block_size,
        dtype=sizes.dtype,
    )
    pool = KVPool(spec, sizes.pool_blocks, device=device)
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where it lives: GiBs on a GPU
    pool.raw.random_(0, 256, generator=gen)
    ids = torch.randperm(sizes.pool_blocks, generator=gen, device=device)[: sizes.pack_blocks]
    half = sizes.kv_heads // 2
    staging = pack_blocks(pool.tensor, ids, 0, half)
    nbytes = staging.numel() * staging.element_size()
    ref = pack_blocks_ref(pool.tensor, ids, 0, half)
    if not torch.equal(staging.view(torch.uint8), ref.view(torch.uint8)):  # bits: NaNs too
        raise AssertionError("pack_blocks differs from its torch reference in the benchmark")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.copy_(staging.view(torch.uint8).reshape(-1))
    t_copy = time_fn(lambda: dst.copy_(src), device, sizes.iters)
    t_pack = time_fn(
        lambda: pack_blocks(pool.tensor, ids, 0, half, out=staging), device, sizes.iters
    )
    t_scatter = time_fn(lambda: scatter_blocks(staging, pool.tensor, ids, 0), device, sizes.iters)
    copy_gbs = nbytes / t_copy / 1e9
    rows = {}
    for name, seconds in (("pack", t_pack), ("scatter", t_scatter)):
        gbs = nbytes / seconds / 1e9
        rows[name] = {"gb_per_s": gbs, "ratio": ratio(gbs, copy_gbs)}
    return {
        "bytes": nbytes,
        "blocks": sizes.pack_blocks,
        "heads": f"0:{half} of {sizes.kv_heads}",
        "dtype": str(sizes.dtype).removeprefix("torch."),
        "reference": "torch device-to-device copy of the same bytes",
        "reference_gb_per_s": copy_gbs,
        **rows,
        "goal": f"ratio >= {GOAL_PACK_RATIO}",
        "meets_goal": min(r["ratio"] for r in rows.values()) >= GOAL_PACK_RATIO,
    }


def bench_paged_decode(sizes: BenchSizes, device: torch.device) -> dict[str, Any]:
    """Seconds per call of paged_decode_attention over a pool (scattered blocks) against SDPA over
    the same keys and values gathered into (B, H_kv, n, D), for each batch size."""
    from kvmesh.kernels.paged_attention import paged_decode_attention
    from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool

    H_q, H_kv, D, bs = sizes.attention_heads, sizes.kv_heads, sizes.head_dim, sizes.block_size
    n = sizes.attention_context
    per_seq = -(-n // bs)
    scale = D**-0.5
    rows = {}
    gen = torch.Generator(device=device).manual_seed(1)
    for B in sizes.attention_batches:
        spec = KVCacheSpec(
            num_layers=1, num_kv_heads=H_kv, head_dim=D, block_size=bs, dtype=sizes.dtype
        )
        pool = KVPool(spec, B * per_seq, device=device)
        k_cache, v_cache = pool.layer(0)
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
        tables = torch.randperm(B * per_seq, generator=gen, device=device).view(B, per_seq)
        lens = torch.full((B,), n, dtype=torch.int64, device=device)
        q = torch.randn(B, H_q, D, generator=gen, device=device, dtype=sizes.dtype)
        # the same data unpaged: (B, H_kv, n, D)
        keys = k_cache[tables].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()
        values = v_cache[tables].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()
        q4 = q[:, :, None, :]

        def sdpa(q4=q4, keys=keys, values=values):
            return torch.nn.functional.scaled_dot_product_attention(
                q4, keys, values, scale=scale, enable_gqa=True
            )

        def kernel(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens):
            return paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)

        err = (kernel().float() - sdpa()[:, :, 0].float()).abs().max().item()
        t_ref = time_fn(sdpa, device, sizes.iters)
        t_kernel = time_fn(kernel, device, sizes.iters)
        rows[str(B)] = {
            "kernel_us": t_kernel * 1e6,
            "sdpa_us": t_ref * 1e6,
            "ratio": ratio(t_ref, t_kernel),  # > 1: the kernel is faster
            "max_abs_err": err,
        }
    meets = [
        r["ratio"] >= GOAL_ATTENTION_RATIO
        for b, r in rows.items()
        if int(b) >= ATTENTION_GOAL_MIN_BATCH
    ]
    return {
        "shape": f"H_q {H_q}, H_kv {H_kv}, D {D}, context {n}, block {bs}",
        "dtype": str(sizes.dtype).removeprefix("torch."),
        "reference": "F.scaled_dot_product_attention(enable_gqa=True) on unpaged K/V",
        "batches": rows,
        "goal": f"ratio (sdpa time / kernel time) >= {GOAL_ATTENTION_RATIO} at batch >= "
        f"{ATTENTION_GOAL_MIN_BATCH}",
        "meets_goal": all(meets) if meets else None,
    }


def bench_quant_matmul(sizes: BenchSizes, device: torch.device) -> dict[str, Any]:
    """Microseconds per call and the weight's GB/s (its stored bytes over the call's time) of
    quant_matmul, of dequantize-then-F.linear, and of F.linear over the dequantized weight, for
    each format and row count of ``sizes``; the largest difference from the reference."""
    import torch.nn.functional as F
    from kvmesh.kernels.quant_matmul import quant_matmul, quant_matmul_ref
    from kvmesh.shared.model.quant import K_FORMATS, dequantize, quantize

    out_features, in_features = sizes.quant_shape
    gen = torch.Generator().manual_seed(2)
    floats = torch.randn(out_features, in_features, generator=gen) * 0.05
    formats: dict[str, Any] = {}
    for fmt in sizes.quant_formats:
        if fmt in K_FORMATS:  # kvmesh writes no K-quants: valid blocks of random bytes
            weight = _random_k(fmt, out_features, in_features, gen).to(device)
        else:
            weight = quantize(floats, fmt).to(device)
        dense = dequantize(weight).to(sizes.dtype)
        rows = {}
        for m in sizes.quant_rows:
            x = torch.randn(m, in_features, generator=gen).to(device, sizes.dtype)
            err = (quant_matmul(x, weight).float() - quant_matmul_ref(x, weight).float()).abs()

            def dequant_then_matmul(x=x, weight=weight):
                return F.linear(x, dequantize(weight).to(x.dtype))

            t_kernel = time_fn(lambda x=x, w=weight: quant_matmul(x, w), device, sizes.iters)
            t_dequant = time_fn(dequant_then_matmul, device, sizes.iters)
            t_dense = time_fn(lambda x=x, d=dense: F.linear(x, d), device, sizes.iters)
            rows[str(m)] = {
                "kernel_us": t_kernel * 1e6,
                "dequantize_matmul_us": t_dequant * 1e6,
                "float_matmul_us": t_dense * 1e6,
                "kernel_weight_gb_per_s": weight.nbytes / t_kernel / 1e9,
                "float_weight_gb_per_s": dense.numel() * dense.element_size() / t_dense / 1e9,
                "ratio_vs_dequantize": ratio(t_dequant, t_kernel),  # > 1: the kernel is faster
                "ratio_vs_float": ratio(t_dense, t_kernel),
                "max_abs_err": err.max().item(),
            }
        formats[fmt] = {"weight_bytes": weight.nbytes, "rows": rows}
    one_row = [
        f["rows"][str(min(sizes.quant_rows))]["ratio_vs_dequantize"] for f in formats.values()
    ]
    goal = f"ratio_vs_dequantize >= {GOAL_QUANT_DECODE_RATIO} at {min(sizes.quant_rows)} row(s)"
    return dict(
        shape=f"{out_features} x {in_features}, x {str(sizes.dtype).removeprefix('torch.')}",
        reference="QuantLinear's dequantize then F.linear; F.linear over the float weight",
        formats=formats,
        goal=goal + ", every format",
        meets_goal=min(one_row) >= GOAL_QUANT_DECODE_RATIO,
    )


def _random_k(fmt: str, rows: int, cols: int, gen: torch.Generator):
    """Random ``fmt`` super-blocks with small float16 scales (every other bit random)."""
    from kvmesh.shared.model.quant import BLOCK_BYTES, QuantWeight

    size = BLOCK_BYTES[fmt]
    raw = torch.randint(0, 256, (rows, cols // 256, size), generator=gen, dtype=torch.uint8)
    scale = torch.tensor([0.002, 0.002], dtype=torch.float16).view(torch.uint8)
    if fmt == "Q6_K":
        raw[..., size - 2 :] = scale[:2]
    else:
        raw[..., 0:4] = scale
    return QuantWeight(fmt, raw.reshape(rows, -1).contiguous(), rows, cols)
