"""Tiny Hugging Face checkpoints built with transformers, for equality tests against the reference.

Reusable by any test (model, engine):

    path = make_llama_checkpoint(tmp_path)            # GQA, untied, llama3 rope scaling
    path = make_qwen2_checkpoint(tmp_path)            # q/k/v bias, tied embeddings, ChatML template
    path = make_llama_checkpoint(tmp_path, max_shard_size="40KB")   # sharded + index.json
    path = make_mistral_checkpoint(tmp_path)          # MQA, explicit head_dim
    ref = load_hf_reference(path)                     # transformers model, float32, eval
    ids, meta = paged_step(...) / greedy_generate(...) # drive kvmesh's model through a KVPool by hand

Each checkpoint has a byte-level BPE tokenizer (256 byte symbols, no merges, plus specials), so any
text round-trips and multi-byte characters are split over several tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model.attention import AttentionMetadata
from kvmesh.shared.model.seeded import write_tokenizer

BLOCK_SIZE = 16
LLAMA_SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _save(model, path: Path, max_shard_size: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)


def make_llama_checkpoint(
    tmp_path: Path,
    name: str = "llama",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Llama with GQA (4 heads, 2 KV heads), untied embeddings, llama3 rope scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        vocab_size=256 + len(LLAMA_SPECIALS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    _save(model, path, max_shard_size)
    write_tokenizer(path, LLAMA_SPECIALS, bos="<s>", eos="</s>", chat_template=LLAMA_CHAT_TEMPLATE)
    return path


def make_qwen2_checkpoint(
    tmp_path: Path,
    name: str = "qwen2",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Qwen2 with q/k/v bias, tied embeddings, no BOS, two EOS ids (generation_config.json)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        vocab_size=256 + len(QWEN2_SPECIALS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[258, 256],
        rope_theta=1000000.0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)).eval()
    with torch.no_grad():  # random biases, so the test notices if they are dropped
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    _save(model, path, max_shard_size)
    write_tokenizer(
        path, QWEN2_SPECIALS, bos=None, eos="<|im_end|>", chat_template=QWEN2_CHAT_TEMPLATE
    )
    return path


def make_mistral_checkpoint(
    tmp_path: Path,
    name: str = "mistral",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Mistral (GQA, no sliding window, explicit head_dim 32 != hidden / heads), Llama tokenizer."""
    from transformers import MistralConfig, MistralForCausalLM

    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        vocab_size=256 + len(LLAMA_SPECIALS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.1,
        sliding_window=None,
        bos_token_id=256,
        eos_token_id=257,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(**kwargs)).eval()
    _save(model, path, max_shard_size)
    write_tokenizer(path, LLAMA_SPECIALS, bos="<s>", eos="</s>", chat_template=LLAMA_CHAT_TEMPLATE)
    return path


def load_hf_reference(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers model for ``path``, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).eval()


def prefill_metadata(
    num_tokens: int, block_table: list[int], start: int = 0, block_size: int = BLOCK_SIZE
) -> AttentionMetadata:
    """Metadata for one sequence adding ``num_tokens`` tokens at positions start..start+num_tokens-1,
    stored through ``block_table`` (a list of block ids)."""
    positions = torch.arange(start, start + num_tokens)
    table = torch.tensor(block_table, dtype=torch.int64)
    slots = table[positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        query_lens=[num_tokens],
        context_lens=torch.tensor([start + num_tokens]),
        block_tables=table[None],
        block_size=block_size,
    )


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, pool: KVPool, block_table: list[int]
) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged cache; argmax sampling."""
    out: list[int] = []
    with torch.inference_mode():
        meta = prefill_metadata(len(prompt_ids), block_table)
        hidden = model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), pool, meta)
        next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
        for step in range(max_new_tokens):
            out.append(next_id)
            if step == max_new_tokens - 1:
                break
            pos = len(prompt_ids) + step
            meta = prefill_metadata(1, block_table, start=pos)
            hidden = model(torch.tensor([next_id]), torch.tensor([pos]), pool, meta)
            next_id = int(model.compute_logits(hidden).argmax(-1))
    return out
