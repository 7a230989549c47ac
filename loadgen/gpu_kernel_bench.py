"""``make gpu-check``'s kernel benchmarks, each against torch in the same run:

* ``bench_kv_pack``: the KV pack and scatter kernels (kernels/kv_pack.py) moving a TP half of the
  heads of scattered blocks, in GB/s, against ``torch`` copying the same bytes device to device
  (goal: ratio >= 0.8).
* ``bench_paged_decode``: the paged decode attention kernel (kernels/paged_attention.py) against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same keys and values laid out
  unpaged, per batch size (goal: ratio >= 1.0 at batch 32 and up).
"""

from __future__ import annotations

from typing import Any

import torch
from kvmesh.loadgen.device_timing import ratio, time_fn
from kvmesh.loadgen.gpu_sizes import BenchSizes

GOAL_PACK_RATIO = 0.8
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
