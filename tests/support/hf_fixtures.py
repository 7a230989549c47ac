"""Tiny Hugging Face checkpoints built with transformers, for equality tests against the reference.

Reusable by any test (model, engine):

    path = make_llama_checkpoint(tmp_path)            # GQA, untied, llama3 rope scaling
    path = make_qwen2_checkpoint(tmp_path)            # q/k/v bias, tied embeddings, ChatML template
    path = make_llama_checkpoint(tmp_path, max_shard_size="40KB")   # sharded + index.json
    path = make_mistral_checkpoint(tmp_path)          # MQA, explicit head_dim
    ref = load_hf_reference(path)                     # transformers model, float32, eval
    ids, meta = paged_step(...) / greedy_generate(...) # drive kvmesh's model through a KVPool by hand
    logits = prefill_logits(model, ids, pool, table)  # every position's logits after one prefill

Each checkpoint has a byte-level BPE tokenizer (256 byte symbols, no merges, plus specials), so any
text round-trips and multi-byte characters are split over several tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Family:
    """A checkpoint family: transformers' class prefix (``Llama`` for LlamaConfig and
    LlamaForCausalLM), its config beyond the shared shape, and its tokenizer."""

    prefix: str
    config: dict[str, Any]
    specials: list[str]
    bos: str | None
    eos: str
    chat_template: str
    random_qkv_bias: bool = False


# The shape every checkpoint here shares: two layers of width 64, four query heads.
_SHARED_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,
)
_LLAMA = _Family(
    "Llama",
    dict(
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
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
    ),
    LLAMA_SPECIALS,
    bos="<s>",
    eos="</s>",
    chat_template=LLAMA_CHAT_TEMPLATE,
)
_QWEN2 = _Family(
    "Qwen2",
    dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[258, 256],
        rope_theta=1000000.0,
    ),
    QWEN2_SPECIALS,
    bos=None,
    eos="<|im_end|>",
    chat_template=QWEN2_CHAT_TEMPLATE,
    random_qkv_bias=True,
)
_MISTRAL = _Family(
    "Mistral",
    dict(
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=None,
        bos_token_id=256,
        eos_token_id=257,
    ),
    LLAMA_SPECIALS,
    bos="<s>",
    eos="</s>",
    chat_template=LLAMA_CHAT_TEMPLATE,
)


def _make_checkpoint(
    family: _Family,
    tmp_path: Path,
    name: str,
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A ``family`` checkpoint with random weights from ``seed`` in ``tmp_path / name``; its config
    is the shared shape and the tokenizer's vocabulary size, then the family's, then ``overrides``."""
    import transformers

    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    config_class = getattr(transformers, f"{family.prefix}Config")
    model_class = getattr(transformers, f"{family.prefix}ForCausalLM")
    torch.manual_seed(seed)
    vocab_size = 256 + len(family.specials)  # the byte symbols, then the specials
    config = {**_SHARED_CONFIG, "vocab_size": vocab_size, **family.config, **overrides}
    model = model_class(config_class(**config)).eval()
    if family.random_qkv_bias:  # so the test notices if they are dropped
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    write_tokenizer(
        path, family.specials, bos=family.bos, eos=family.eos, chat_template=family.chat_template
    )
    return path


def make_llama_checkpoint(tmp_path: Path, name: str = "llama", **options: Any) -> Path:
    """Llama with GQA (4 heads, 2 KV heads), untied embeddings, llama3 rope scaling.
    ``options``: ``max_shard_size``, ``seed``, and config overrides (``_make_checkpoint``)."""
    return _make_checkpoint(_LLAMA, tmp_path, name, **options)


def make_qwen2_checkpoint(tmp_path: Path, name: str = "qwen2", **options: Any) -> Path:
    """Qwen2 with q/k/v bias, tied embeddings, no BOS, two EOS ids (generation_config.json)."""
    return _make_checkpoint(_QWEN2, tmp_path, name, **options)


def make_mistral_checkpoint(tmp_path: Path, name: str = "mistral", **options: Any) -> Path:
    """Mistral (GQA, no sliding window, explicit head_dim 32 != hidden / heads), Llama tokenizer."""
    return _make_checkpoint(_MISTRAL, tmp_path, name, **options)


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


def prefill_logits(
    model, ids: list[int], pool: KVPool, block_table: list[int], block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Every position's logits from kvmesh's ``model`` after one prefill of ``ids`` (positions 0
    on), its KV stored in ``pool`` through ``block_table``."""
    meta = prefill_metadata(len(ids), block_table, block_size=block_size)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), pool, meta))


def greedy_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    pool: KVPool,
    block_table: list[int],
    backend=None,
) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged cache; argmax
    sampling. ``backend``: the one installed on ``model``, which plans each decode step."""
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
            if backend is not None:
                meta.cpu_plan = backend.plan_step(meta, pool)
            hidden = model(torch.tensor([next_id]), torch.tensor([pos]), pool, meta)
            next_id = int(model.compute_logits(hidden).argmax(-1))
    return out
