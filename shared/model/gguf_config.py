"""A Llama GGUF's hyperparameters as Hugging Face ``config.json`` and ``generation_config.json``.

llama.cpp keeps them under ``llama.*`` keys (``llama.block_count``, ``llama.attention.head_count``
...); the special token ids under ``tokenizer.ggml.*``. The vocabulary size is the embedding's row
count, tied embeddings are the absence of ``output.weight``. What the Llama decoder would compute
differently from llama.cpp (Llama 3.1's frequency-scaled RoPE, YaRN) is refused by name.
"""

from __future__ import annotations

from typing import Any

from kvmesh.shared.model.config import ModelConfig, ModelConfigError
from kvmesh.shared.model.gguf_file import GGUFError, GGUFFile
from kvmesh.shared.model.seeded import hf_config_dict

# tokenizer.ggml.* keys of tokens that end a turn (llama.cpp stops on each of them)
_EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


def model_config(gguf: GGUFFile, dtype: str) -> ModelConfig:
    """The validated kvmesh config of the file's model, its weights in ``dtype``."""
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFError(
            f"{gguf.path}: the model scales RoPE frequencies per dimension (rope_freqs.weight, "
            "Llama 3.1 style); kvmesh cannot recover those parameters from a GGUF: import the "
            "Hugging Face checkpoint instead"
        )
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise GGUFError(f"{gguf.path}: no 2-D token_embd.weight tensor; not a Llama model")
    vocab_size, hidden = embedding.shape
    num_heads = int(gguf.arch_key("attention.head_count"))
    head_dim = int(
        gguf.arch_key("attention.key_length", 0) or gguf.arch_key("rope.dimension_count", 0) or 0
    ) or hidden // max(num_heads, 1)
    try:
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=vocab_size,
            hidden_size=int(gguf.arch_key("embedding_length")),
            intermediate_size=int(gguf.arch_key("feed_forward_length")),
            num_hidden_layers=int(gguf.arch_key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(gguf.arch_key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(gguf.arch_key("context_length", 4096)),
            rope_theta=float(gguf.arch_key("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(gguf),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_token_ids(gguf),
            dtype=dtype,
            source=str(gguf.path),
        )
    except ModelConfigError as e:
        raise GGUFError(str(e)) from None


def eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """Every token id the file marks as ending generation (EOS, end of turn, end of message)."""
    ids = (gguf.metadata.get(f"tokenizer.ggml.{key}") for key in _EOS_KEYS)
    return tuple(sorted({int(i) for i in ids if i is not None}))


def hf_config(config: ModelConfig, gguf: GGUFFile) -> dict[str, Any]:
    """config.json of the imported checkpoint."""
    raw = hf_config_dict(config)
    raw["torch_dtype"] = config.dtype
    if config.rope_scaling is not None:
        raw["rope_scaling"] = dict(config.rope_scaling)
    pad = gguf.metadata.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        raw["pad_token_id"] = int(pad)
    return raw


def generation_config(config: ModelConfig) -> dict[str, Any]:
    """generation_config.json: which ids start and end a sequence (greedy by default, as
    llama.cpp's converter leaves it)."""
    out: dict[str, Any] = {"eos_token_id": list(config.eos_token_ids)}
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    return out


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    kind = gguf.arch_key("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf.arch_key("rope.scaling.factor"))}
    raise GGUFError(
        f"{gguf.path}: RoPE scaling {kind!r} is not supported by kvmesh's importer (supported: "
        "none, linear)"
    )
