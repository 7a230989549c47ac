"""``make gpu-check``'s engine benchmark: the engine's decode tokens/s against transformers' (its
own KV cache, SDPA attention) on the same seeded weights (``realistic_model.py``), per batch
size (goal: ratio >= 2), and how many greedy tokens the two agree on."""

from __future__ import annotations

import time
from typing import Any

import torch
from kvmesh.loadgen.device_timing import ratio, sync
from kvmesh.loadgen.gpu_sizes import BenchSizes
from kvmesh.loadgen.kv_accuracy_report import agreed_prefix
from kvmesh.loadgen.realistic_model import realistic_config, seeded_models

GOAL_ENGINE_RATIO = 2.0


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
    sync(device)
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            produced += len(out.new_token_ids)
    sync(device)
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
    sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = hf(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(nxt)
    sync(device)
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
        same_prefix = [agreed_prefix(a, b) for a, b in zip(engine_tokens, hf_tokens, strict=True)]
        rows[str(B)] = {
            "engine_tok_per_s": engine_rate,
            "transformers_tok_per_s": hf_rate,
            "ratio": ratio(engine_rate, hf_rate),
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
