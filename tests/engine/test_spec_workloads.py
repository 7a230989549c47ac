"""kvmesh bench spec's workloads (loadgen/spec_workloads.py): token ids of the model's own
tokenizer; the quote workload is the seeded figures' byte-level prompts unchanged."""

from __future__ import annotations

import random

import pytest
from kvmesh.loadgen.spec_workloads import QUESTIONS, workload_prompts
from kvmesh.shared.model.tiny import tiny_tokenizer


def test_quote_prompts_on_kvmesh_tiny_are_the_passages_bytes() -> None:
    """The prompts the README's seeded figures were measured on (bytes of the text)."""
    rng = random.Random(3)
    words = ["the", "mesh", "decode", "prefill", "block", "cache", "token", "draft", "verify"]
    text = " ".join(rng.choice(words) for _ in range(600 // 5))
    expected = f"Passage: {text}\nRepeat the passage.\nPassage: {text[: len(text) // 4]}"
    assert workload_prompts("quote", tiny_tokenizer(), 1, 600, seed=3) == [list(expected.encode())]


def test_chat_and_copy_prompts_are_in_the_chat_template() -> None:
    tok = tiny_tokenizer()
    chat = workload_prompts("chat", tok, 8, 600, seed=8)
    assert len(chat) == 8 and len({tuple(p) for p in chat}) == 8
    texts = [tok.decode(p, skip_special_tokens=False) for p in chat]
    assert all(t.startswith("<|bos|><|user|>") and t.endswith("<|assistant|>") for t in texts)
    assert sum(q in t for t in texts for q in QUESTIONS) == 8
    copy = [tok.decode(p) for p in workload_prompts("copy", tok, 4, 600, seed=0)]
    assert sum("Repeat this text exactly" in t for t in copy) == 2
    assert sum("```python" in t and "give back the whole code" in t for t in copy) == 2


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of quote, chat, copy"):
        workload_prompts("poetry", tiny_tokenizer(), 1, 600)
