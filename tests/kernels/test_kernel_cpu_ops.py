"""kernels/cpu_ops.c against the torch definitions it replaces on the float32 CPU decode path."""

import itertools
import shutil

import pytest
import torch
from kvmesh.kernels import cpu_ops
from kvmesh.kernels.cpu_ops import (
    CpuOpsBuildError,
    build,
    linear_reference,
    load_cpu_ops,
    pack_linear_weight,
    rms_norm_reference,
    silu_mul_reference,
    split_by_work,
)
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention
from kvmesh.shared.model.rope import apply_rope
from kvmesh.shared.text.sampling import SamplingOptions
from support.cpu_layers import random_cache


@pytest.mark.parametrize("shape", [(1, 256), (7, 100), (33, 17)])
def test_rms_norm_matches_reference(ops, shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape) * 3, torch.randn(shape[1])
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("shape", [(1, 2 * 768), (5, 2 * 37)])
def test_silu_mul_matches_reference_over_the_whole_range(ops, shape):
    torch.manual_seed(0)
    gate_up = torch.randn(shape) * 30  # exp far into both tails
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(ops.silu_mul(gate_up), silu_mul_reference(gate_up))


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "threads"),
    [
        (1, 512, 768, 1),
        (1, 64, 40, 2),
        (1, 8, 80, 2),
        (5, 64, 40, 1),
        (7, 100, 17, 2),
        (33, 48, 200, 2),
        (200, 32, 16, 3),
    ],
)
@pytest.mark.parametrize("has_bias", [False, True])
def test_packed_linear_matches_reference(ops, rows, in_features, out_features, threads, has_bias):
    torch.manual_seed(0)
    x = torch.randn(rows, in_features)
    # the layout kvmesh's Linear stores (column-major): packing reads any strides
    weight = torch.randn(in_features, out_features).t()
    bias = torch.randn(out_features) if has_bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.linear(x, pack_linear_weight(weight), bias)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_features", [768, 40])  # whole pairs of panels; a partial one
def test_packed_linear_rows_do_not_depend_on_the_rows_beside_them(ops, out_features):
    # draft rows verify as plain decode rows bit for bit: each row's sums are the same whether
    # it comes alone (pair_row), with a few others (pair_rows) or with many (tiles)
    g = torch.Generator().manual_seed(3)
    w = pack_linear_weight(torch.randn(out_features, 256, generator=g))
    x = torch.randn(12, 256, generator=g)
    alone = torch.cat([ops.linear(x[r : r + 1], w) for r in range(12)])
    for m in (2, 3, 5, 6, 9, 12):
        assert torch.equal(ops.linear(x[:m], w), alone[:m]), m


def test_packed_weight_pads_the_last_panel_with_zeros():
    packed = pack_linear_weight(torch.ones(20, 3))
    assert packed.panels.shape == (2, 3, 16) and packed.out_features == 20
    assert packed.panels[1, :, :4].eq(1).all() and packed.panels[1, :, 4:].eq(0).all()


def test_wrappers_refuse_wrong_dtype_and_layout(ops):
    with pytest.raises(AssertionError, match="float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-5)
    with pytest.raises(AssertionError, match="contiguous"):
        ops.silu_mul(torch.randn(16, 4).t())
    with pytest.raises(AssertionError, match="contiguous"):
        ops.linear(torch.randn(8, 2).t(), pack_linear_weight(torch.randn(4, 2)))


def _decode_case(
    num_q_heads, num_kv_heads, head_dim, context_lens, block_size=16, seed=0, dtype=torch.float32
):
    """A pool holding earlier tokens of each sequence, and a decode step's inputs."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(
        num_layers=3,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    pool, tables = random_cache(spec, context_lens, g, spare_blocks=3)
    B = len(context_lens)
    qkv = torch.randn(B, num_q_heads + 2 * num_kv_heads, head_dim, generator=g)
    angles = torch.rand(B, 1, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    return pool, tables, torch.tensor(context_lens), qkv, cos, sin


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,context_lens,block_size",
    [
        (4, 2, 64, [1, 15, 16, 17, 100], 16),  # kvmesh-tiny's shape; block edges
        (8, 1, 128, [40, 3], 16),  # a group of 8
        (3, 3, 80, [33], 16),  # no grouping, a head size the kernel does not specialise
        (2, 1, 40, [18, 64], 16),  # head size with a partial vector
        (4, 2, 64, [7, 50], 8),  # blocks smaller than one vector of keys
        (4, 1, 64, [70], 32),  # two vectors of keys per block
        (6, 2, 48, [33, 300], 16),  # a group of 3: the value loop's three-head case
        (10, 2, 64, [45, 1200], 16),  # a group of 5: four heads, then one; a long context
    ],
)
@pytest.mark.parametrize("threads", [1, 3])  # 3: the batch in parts, one per OpenMP thread
def test_decode_attention_matches_torch_path(
    ops, num_q_heads, num_kv_heads, head_dim, context_lens, block_size, threads
):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_decode_attention(ops, num_q_heads, num_kv_heads, head_dim, context_lens, block_size)
    finally:
        torch.set_num_threads(saved)


def _check_decode_attention(
    ops, num_q_heads, num_kv_heads, head_dim, context_lens, block_size, dtype=torch.float32
):
    bs = block_size
    pool, tables, ctx, qkv, cos, sin = _decode_case(
        num_q_heads, num_kv_heads, head_dim, context_lens, bs, dtype=dtype
    )
    layer = 1
    ref_pool = KVPool(pool.spec, pool.num_blocks)
    ref_pool.tensor.copy_(pool.tensor)
    # torch path: rotate q and k, store k and v, attend
    H = num_q_heads
    qk = apply_rope(qkv[:, : H + num_kv_heads], cos, sin)
    q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + num_kv_heads :]
    pos = ctx - 1
    slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
    meta = AttentionMetadata(slots, [1] * len(context_lens), ctx, tables, bs)
    scale = head_dim**-0.5
    expected = paged_attention(q, k, v, *ref_pool.layer(layer), meta, scale)

    out = ops.decode_attention(qkv, cos, sin, *pool.layer(layer), tables, ctx, H, scale)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    # the rotary embedding is bit for bit torch's, and so is every stored key and value (a half
    # cache's too: rounded to nearest even as torch's cast)
    assert torch.equal(qkv[:, :H], q)
    assert torch.equal(pool.tensor, ref_pool.tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,context_lens,block_size",
    [
        (9, 3, 64, [1, 17, 1030], 16),  # SmolLM2's heads: a group of 3, 1k context
        (3, 3, 80, [33], 16),  # a head size the kernel does not specialise
        (2, 1, 40, [18, 64], 16),  # a partial vector: the scalar reads of half elements
        (8, 1, 128, [7, 50], 8),  # a group of 8, blocks smaller than one vector of keys
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_attention_over_a_half_cache_matches_torch_path(
    ops, dtype, num_q_heads, num_kv_heads, head_dim, context_lens, block_size, threads
):
    """A float16 or bfloat16 pool (--kv-cache-dtype float16/bfloat16): the kernels store the
    new K/V as torch's cast does and read the context as the torch path's float32 upcast."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_decode_attention(
            ops, num_q_heads, num_kv_heads, head_dim, context_lens, block_size, dtype
        )
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(
    "lens,parts,expected",
    [
        ([10, 10, 10, 10], 2, [(0, 2), (2, 4)]),
        ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # one long context is a part of its own
        ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
        ([1, 2, 3, 4, 5, 6, 7, 8], 3, [(0, 4), (4, 6), (6, 8)]),  # 10, 11, 15 of 36
        ([3, 3, 3], 3, [(0, 1), (1, 2), (2, 3)]),
        ([5], 4, [(0, 1)]),  # never more parts than sequences, never an empty one
        ([1, 1], 5, [(0, 1), (1, 2)]),
        ([9, 9], 1, [(0, 2)]),
    ],
)
def test_split_by_work_balances_context_in_consecutive_runs(lens, parts, expected):
    assert split_by_work(lens, parts) == expected


def test_split_by_work_covers_the_batch_in_order_for_any_lengths():
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = int(torch.randint(1, 40, (1,), generator=rng))
        lens = torch.randint(1, 5000, (batch,), generator=rng).tolist()
        parts = int(torch.randint(1, 9, (1,), generator=rng))
        runs = split_by_work(lens, parts)
        assert len(runs) == min(parts, batch)
        assert runs[0][0] == 0 and runs[-1][1] == batch
        assert all(a < b for a, b in runs) and all(
            x[1] == y[0] for x, y in itertools.pairwise(runs)
        )


def test_decode_attention_refuses_mismatched_cache(ops):
    pool, tables, ctx, qkv, cos, sin = _decode_case(4, 2, 64, [5])
    k_cache, v_cache = pool.layer(0)
    with pytest.raises(AssertionError):
        ops.decode_attention(qkv, cos, sin, k_cache, v_cache[:, :, :1], tables, ctx, 4, 0.1)
    with pytest.raises(AssertionError):  # 3 query heads do not split over 2 KV heads
        ops.decode_attention(qkv[:, 1:], cos, sin, k_cache, v_cache, tables, ctx, 3, 0.1)


def test_build_without_a_compiler_says_what_is_missing(tmp_path):
    with pytest.raises(CpuOpsBuildError, match="no C compiler 'no-such-cc'"):
        build(tmp_path, compiler="no-such-cc")


def test_load_without_a_compiler_falls_back_to_none(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    assert load_cpu_ops.__wrapped__() is None


@pytest.mark.slow  # seconds: left out of make test-fast
def test_build_is_cached_by_source_and_machine(tmp_path):
    first = build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_engine_gives_the_same_tokens_with_and_without_cpu_kernels(tiny, kv_cache_dtype):
    model, tok = tiny
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 90)]
    params = SamplingOptions(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = []
    for cpu_kernels in (True, False):
        config = EngineConfig(num_blocks=64, cpu_kernels=cpu_kernels, kv_cache_dtype=kv_cache_dtype)
        engine = LLMEngine(model, tok, config)
        assert (engine.runner.cpu_ops is not None) == cpu_kernels
        assert engine.kv_pool.spec.dtype == (
            torch.float16 if kv_cache_dtype == "float16" else torch.float32
        )
        outputs.append(engine.generate(prompts, params))
    assert outputs[0] == outputs[1]


def test_build_falls_back_to_the_temp_folder_when_the_cache_cannot_be_made(
    monkeypatch, tmp_path, ops
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(blocker / "kvmesh"))  # mkdir fails: not a dir
    monkeypatch.setattr(cpu_ops, "_temp_cache_dir", lambda: tmp_path / "tmp-cache")
    # The temp folder already holds this machine's build (compiling is the test above's): the
    # fallback is told by the folder build() picks, not by seconds of compiling again.
    (tmp_path / "tmp-cache").mkdir()
    shutil.copy(ops.path, tmp_path / "tmp-cache" / ops.path.name)
    assert build() == tmp_path / "tmp-cache" / ops.path.name
