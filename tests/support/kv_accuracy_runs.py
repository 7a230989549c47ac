"""The KV-accuracy measurement of ``loadgen/kv_accuracy.py`` as the 8-bit KV cache tests run it."""

from __future__ import annotations

from typing import Any

from kvmesh.loadgen.kv_accuracy import FIXTURE_PROMPTS, measure


def fixture_prompts_report(model_and_tokenizer: tuple[Any, Any], kv_cache_dtype: str):
    """``measure`` on the fixture prompts, 16 greedy tokens each: the model with a
    ``kv_cache_dtype`` KV cache against the same model with float32 KV."""
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in FIXTURE_PROMPTS]
    return measure(model, prompts, max_tokens=16, kv_cache_dtype=kv_cache_dtype)
