"""Seeded Hugging Face checkpoints: a Llama of any shape, its weights drawn from a seed, written as
a checkpoint directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

No weights can be downloaded where kvmesh is built and benchmarked, yet load tests, engine
benchmarks and llama.cpp comparisons need a model of realistic size served through the same
``--model PATH`` code path real users take. The weights come from kvmesh-tiny's integer-only draw
(:func:`kvmesh.shared.model.tiny.tiny_state_dict`), so one seed and shape give the same bits on every
machine; the tokenizer is byte-level (256 byte symbols, no merges) with kvmesh-tiny's specials and
chat template, as a ``tokenizers`` tokenizer.json that transformers reads as it is. llama.cpp's
converter does not take it as written: it knows no pre-tokenizer by this tokenizer's hash, and
llama.cpp loads no BPE vocabulary without merges; ``kvmesh.loadgen.llamacpp_runner`` works around
both when it converts (the GPT-2 pre-tokenizer, and one inert merge of two special tokens).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.tiny import TINY_CHAT_TEMPLATE, TINY_SPECIALS, tiny_state_dict


@dataclasses.dataclass(frozen=True, slots=True)
class SeededShape:
    """The shape of a seeded Llama. The defaults are the 23M-parameter model of the load issue
    (hidden 512, 8 layers, 8 heads / 2 KV heads of 64, 93 MB of float32 weights)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int = 1408
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0

    def config(self) -> ModelConfig:
        """The kvmesh config of this shape (validates it: heads divide, sizes positive)."""
        specials = len(TINY_SPECIALS)
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=256 + specials,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            rms_norm_eps=1e-5,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            bos_token_id=256 + TINY_SPECIALS.index("<|bos|>"),
            eos_token_ids=(
                256 + TINY_SPECIALS.index("<|eos|>"),
                256 + TINY_SPECIALS.index("<|end|>"),
            ),
            source="seeded",
        )


def num_parameters(config: ModelConfig) -> int:
    """Parameters of an untied, bias-free Llama of this config."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    return config.num_hidden_layers * layer + 2 * config.vocab_size * h + h


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """config.json of a transformers ``LlamaForCausalLM`` with these fields."""
    return {
        "architectures": [config.architecture],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": "float32",
    }


def byte_level_tokenizer(specials: list[str] | tuple[str, ...], bos: str | None) -> Any:
    """A ``tokenizers`` byte-level BPE over the 256 byte symbols; specials get ids 256, 257, ...
    With ``bos``, encoding prepends it (as Llama's tokenizers do)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def write_tokenizer(
    path: Path,
    specials: list[str] | tuple[str, ...],
    bos: str | None,
    eos: str,
    chat_template: str,
) -> None:
    """tokenizer.json and tokenizer_config.json of a byte-level tokenizer into ``path``."""
    byte_level_tokenizer(specials, bos).save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "eos_token": eos,
        "chat_template": chat_template,
        "add_bos_token": bos is not None,
    }
    if bos is not None:
        config["bos_token"] = {"content": bos, "special": True, "__type": "AddedToken"}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_hf_weights(path: Path, config: ModelConfig, weights: dict[str, Any]) -> None:
    """config.json and model.safetensors of a transformers Llama checkpoint (HF tensor names)."""
    from safetensors.torch import save_file

    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))


def write_seeded_checkpoint(path: Path, shape: SeededShape, seed: int) -> ModelConfig:
    """Write the checkpoint of ``shape`` drawn from ``seed`` into the directory ``path`` (created;
    it must not hold a checkpoint already). Returns the model's config."""
    config = shape.config()
    path.mkdir(parents=True, exist_ok=True)
    existing = [name for name in ("config.json", "model.safetensors") if (path / name).exists()]
    if existing:
        raise FileExistsError(f"{path} already holds {', '.join(existing)}; choose an empty folder")
    write_hf_weights(path, config, tiny_state_dict(config, seed=seed))
    write_tokenizer(
        path, TINY_SPECIALS, bos="<|bos|>", eos="<|end|>", chat_template=TINY_CHAT_TEMPLATE
    )
    return config
