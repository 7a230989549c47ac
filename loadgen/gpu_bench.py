"""The benchmarks of ``make gpu-check`` (scripts/gpu_check.py), each against a reference in the
same run, and the seeded model of realistic shape the GPU tests share.

* ``bench_kv_pack``: the KV pack and scatter kernels (kernels/kv_pack.py) moving a TP half of the
  heads of scattered blocks, in GB/s, against ``torch`` copying the same bytes device to device
  (goal: ratio >= 0.8).
* ``bench_paged_decode``: the paged decode attention kernel (kernels/paged_attention.py) against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same keys and values laid out
  unpaged, per batch size (goal: ratio >= 1.0 at batch 32 and up).
* ``bench_engine_decode``: the engine's decode tokens/s against transformers' (its own KV cache,
  SDPA attention) on the same weights, per batch size (goal: ratio >= 2).

Every figure comes from timing on ``device`` after a warm-up (Triton compiles on first use).
``DRY_SIZES`` runs the same code on the CPU at tiny sizes (Triton under ``TRITON_INTERPRET=1``):
those figures check the code paths only and say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GOAL_PACK_RATIO = 0.8
GOAL_ATTENTION_RATIO = 1.0  # at batch >= ATTENTION_GOAL_MIN_BATCH
ATTENTION_GOAL_MIN_BATCH = 32
GOAL_ENGINE_RATIO = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class BenchSizes:
    """How big each benchmark runs. ``GPU_SIZES`` are the issue's; ``DRY_SIZES`` only exercise
    the code on a CPU."""

    dtype: torch.dtype
    # kv pack/scatter: a pool of pool_blocks blocks, pack_blocks of them (scattered), half the heads
    pool_blocks: int
    pack_blocks: int
    kv_heads: int
    layers: int
    block_size: int
    head_dim: int
    # paged decode attention
    attention_batches: tuple[int, ...]
    attention_heads: int  # query heads (kv_heads KV heads)
    attention_context: int
    # engine decode
    engine_batches: tuple[int, ...]
    engine_prompt_len: int
    engine_new_tokens: int
    model: dict[str, int]  # the seeded model's shape (realistic_config's arguments)
    iters: int  # timed repetitions of a kernel


GPU_SIZES = BenchSizes(
    dtype=torch.bfloat16,
    pool_blocks=2048,
    pack_blocks=512,
    kv_heads=8,
    layers=16,
    block_size=16,
    head_dim=64,
    attention_batches=(1, 32, 128),
    attention_heads=32,
    attention_context=2048,
    engine_batches=(1, 64),
    engine_prompt_len=128,
    engine_new_tokens=128,
    model=dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, vocab_size=32000),
    iters=20,
)

DRY_SIZES = BenchSizes(
    dtype=torch.float32,
    pool_blocks=8,
    pack_blocks=4,
    kv_heads=2,
    layers=2,
    block_size=4,
    head_dim=8,
    attention_batches=(1, 2),
    attention_heads=4,
    attention_context=12,
    engine_batches=(1, 2),
    engine_prompt_len=8,
    engine_new_tokens=4,
    model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=300),
    iters=2,
)


# --- the seeded model of realistic shape ---------------------------------------------------------


def realistic_config(
    hidden_size: int = 2048,
    num_layers: int = 16,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    vocab_size: int = 32000,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """The ModelConfig of a seeded Llama; the defaults are Llama-3.2-1B's shape (hidden 2048,
    16 layers, 32 heads, 8 KV heads, intermediate 8192) with a 32k vocabulary. Token ids past the
    byte-level tokenizer's ~260 are never decoded to text here (greedy ids are compared)."""
    from kvmesh.shared.model.seeded import SeededShape

    shape = SeededShape(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )
    return dataclasses.replace(shape.config(), vocab_size=vocab_size, dtype=dtype)


SEEDED_CACHE_ENV = "KVMESH_GPU_SEEDED_DIR"  # gpu_check shares one checkpoint with the tests


def seeded_checkpoint(config: Any, seed: int, root: Path) -> Path:
    """A transformers Llama checkpoint (float32 safetensors, byte-level tokenizer) of ``config``'s
    shape with ``tiny_state_dict`` weights from ``seed``, under ``root``; reused when written
    before (drawing 1.1 B parameters on the CPU takes about a minute, so gpu_check writes it once
    for its tests and its benchmark)."""
    from kvmesh.shared.model.seeded import hf_config_dict, write_hf_weights, write_tokenizer
    from kvmesh.shared.model.tiny import TINY_CHAT_TEMPLATE, TINY_SPECIALS, tiny_state_dict

    c = config
    name = f"seed{seed}-h{c.hidden_size}-l{c.num_hidden_layers}-a{c.num_attention_heads}"
    path = root / f"{name}-kv{c.num_key_value_heads}-v{c.vocab_size}"
    done = path / "done.json"
    if done.exists() and json.loads(done.read_text()) == hf_config_dict(config):
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_hf_weights(path, config, tiny_state_dict(config, seed=seed))
    write_tokenizer(path, TINY_SPECIALS, "<|bos|>", "<|end|>", TINY_CHAT_TEMPLATE)
    done.write_text(json.dumps(hf_config_dict(config)))
    return path


def seeded_models(
    config: Any, seed: int, device: str | torch.device, root: Path | None = None
) -> tuple[Any, Any]:
    """(kvmesh model, transformers model) of the same seeded weights, both in ``config.dtype`` on
    ``device``, loaded from ``seeded_checkpoint`` under ``root`` (default: $KVMESH_GPU_SEEDED_DIR,
    else a temporary folder). transformers uses its default (SDPA) attention."""
    from kvmesh.shared.model.loader import load_model
    from transformers import AutoModelForCausalLM

    with contextlib.ExitStack() as stack:
        if root is None:
            cached = os.environ.get(SEEDED_CACHE_ENV)
            root = (
                Path(cached) if cached else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            )
        path = seeded_checkpoint(config, seed, root)
        model, _ = load_model(str(path), config.torch_dtype, device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype).to(device)
    return model, hf.eval()


# --- timing ----------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` on ``device``: one warm-up call, then the mean of ``iters``."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else float("inf")


# --- KV pack / scatter -----------------------------------------------------------------------------


def bench_kv_pack(sizes: BenchSizes, device: torch.device) -> dict[str, Any]:
    """GB/s of pack_blocks and scatter_blocks moving heads [0, H/2) of ``pack_blocks`` scattered
    blocks, against ``torch`` copying a contiguous tensor of the same bytes on the same device."""
    from kvmesh.kernels.kv_pack import pack_blocks, scatter_blocks
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
    if not torch.equal(staging.view(torch.uint8), _pack_ref(pool.tensor, ids, half)):
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
        rows[name] = {"gb_per_s": gbs, "ratio": _ratio(gbs, copy_gbs)}
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


def _pack_ref(pool: torch.Tensor, ids: torch.Tensor, half: int) -> torch.Tensor:
    """The staging bytes by plain indexing (the pool's block size is kept)."""
    return pool[ids.long()][:, :half].contiguous().view(torch.uint8)


# --- paged decode attention ---------------------------------------------------------------------


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
            "ratio": _ratio(t_ref, t_kernel),  # > 1: the kernel is faster
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


# --- engine decode -------------------------------------------------------------------------------


def engine_decode_rate(
    model: Any, device: torch.device, batch: int, prompts: torch.Tensor, new_tokens: int
) -> tuple[float, list[list[int]]]:
    """(decode tokens/s, each request's tokens) of LLMEngine: every prompt prefilled first, then
    the steps producing the next ``new_tokens`` tokens of all of them timed."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    P = prompts.shape[1]
    block_size = 16
    blocks = batch * -(-(P + new_tokens + 1) // block_size) + 1
    config = EngineConfig(
        block_size=block_size,
        num_blocks=blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch * P, block_size),
        device=str(device),
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, None, config)
    params = SamplingOptions(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, params)
        tokens[str(i)] = []
    while any(not t for t in tokens.values()):  # prefill: every request's first token
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    _sync(device)
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            produced += len(out.new_token_ids)
    _sync(device)
    elapsed = time.perf_counter() - t0
    return produced / elapsed, [tokens[str(i)] for i in range(batch)]


@torch.inference_mode()
def hf_decode_rate(
    hf: Any, device: torch.device, prompts: torch.Tensor, new_tokens: int
) -> tuple[float, list[list[int]]]:
    """(decode tokens/s, tokens) of transformers greedy decoding with its own KV cache: one
    forward over the prompts, then ``new_tokens`` one-token forwards timed."""
    ids = prompts.to(device)
    out = hf(ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    steps = [nxt]
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = hf(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(nxt)
    _sync(device)
    elapsed = time.perf_counter() - t0
    return ids.shape[0] * new_tokens / elapsed, torch.cat(steps, dim=1).tolist()


def bench_engine_decode(
    sizes: BenchSizes, device: torch.device, models: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Decode tokens/s of the engine and of transformers on the seeded model of ``sizes.model``,
    per batch size; also how many greedy tokens the two agree on (bf16 may split near-ties)."""
    config = realistic_config(**sizes.model, dtype=sizes.dtype)
    model, hf = models or seeded_models(config, seed=0, device=device)
    gen = torch.Generator(device="cpu").manual_seed(2)
    rows = {}
    for B in sizes.engine_batches:
        prompts = torch.randint(0, config.vocab_size, (B, sizes.engine_prompt_len), generator=gen)
        # warm-up (Triton compiles, allocator, cuBLAS handles), then the timed run
        engine_decode_rate(model, device, B, prompts, 2)
        hf_decode_rate(hf, device, prompts, 2)
        engine_rate, engine_tokens = engine_decode_rate(
            model, device, B, prompts, sizes.engine_new_tokens
        )
        hf_rate, hf_tokens = hf_decode_rate(hf, device, prompts, sizes.engine_new_tokens)
        same_prefix = [_common_prefix(a, b) for a, b in zip(engine_tokens, hf_tokens, strict=True)]
        rows[str(B)] = {
            "engine_tok_per_s": engine_rate,
            "transformers_tok_per_s": hf_rate,
            "ratio": _ratio(engine_rate, hf_rate),
            "greedy_tokens_equal_before_first_difference_mean": sum(same_prefix) / B,
            "tokens_per_request": sizes.engine_new_tokens + 1,
        }
    return {
        "model": {**sizes.model, "intermediate_size": config.intermediate_size},
        "dtype": str(sizes.dtype).removeprefix("torch."),
        "prompt_len": sizes.engine_prompt_len,
        "reference": "transformers LlamaForCausalLM (SDPA, DynamicCache), same weights",
        "cuda_graphs": False,  # the engine has none yet: docs/gpu.md
        "batches": rows,
        "goal": f"ratio >= {GOAL_ENGINE_RATIO}",
        "meets_goal": all(r["ratio"] >= GOAL_ENGINE_RATIO for r in rows.values()),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


BENCHMARKS: dict[str, Callable[[BenchSizes, torch.device], dict[str, Any]]] = {
    "kv_pack": bench_kv_pack,
    "paged_decode_attention": bench_paged_decode,
    "engine_decode": bench_engine_decode,
}


def run_all(
    sizes: BenchSizes,
    device: torch.device,
    dry_run: bool = False,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """Every benchmark (or those named in ``only``); one that raises is recorded with its error
    and the others still run. ``dry_run``: each result says so and claims no goal (its figures
    are not a GPU's)."""
    results: dict[str, Any] = {}
    for name, bench in BENCHMARKS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result = bench(sizes, device)
        except Exception as exc:  # a GPU session must see every failure in one run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        if dry_run:
            result["dry_run"] = True
            if "meets_goal" in result:
                result["meets_goal"] = "n/a (dry run)"
        results[name] = result
    return results
