"""kvmesh-tiny: the default model, a 3.3M-parameter Llama with a byte-level tokenizer.

Its weights are drawn from a fixed-seed ``torch.Generator`` on the CPU, so every process on every
machine builds the same bits; prefill and decode workers can therefore check each other's KV
blocks without shipping a checkpoint. The weights are random: the model produces noise, but
deterministic noise, which is what tests and benchmarks of the serving system need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

TINY_NAME = "kvmesh-tiny"
TINY_SEED = 20240611
TINY_SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('kvmesh-tiny chat roles are system, user and assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tiny_config(dtype: torch.dtype | str = "float32") -> ModelConfig:
    """hidden 256, 4 layers, 4 heads / 2 KV heads of 64, vocab 256 bytes + 6 specials."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256 + len(TINY_SPECIALS),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=256 + TINY_SPECIALS.index("<|bos|>"),
        eos_token_ids=(256 + TINY_SPECIALS.index("<|eos|>"), 256 + TINY_SPECIALS.index("<|end|>")),
        dtype=dtype,
        source=TINY_NAME,
    )


def tiny_tokenizer() -> Tokenizer:
    """The byte-level tokenizer and chat template of kvmesh-tiny."""
    return Tokenizer.byte_level(
        TINY_SPECIALS,
        bos_token="<|bos|>",
        eos_tokens=["<|eos|>", "<|end|>"],
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_state_dict(
    config: ModelConfig | None = None, seed: int = TINY_SEED
) -> dict[str, torch.Tensor]:
    """float32 weights under Hugging Face Llama tensor names, identical on every call and machine."""
    import torch

    config = config or tiny_config()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    std = 0.02
    # Scale the residual-branch outputs down with depth (GPT-2 style) so activations stay O(1).
    out_std = std / (2 * config.num_hidden_layers) ** 0.5

    def uniform(*shape: int, scale: float = std) -> torch.Tensor:
        # Uniform with standard deviation ``scale``, from integers only: torch.randn's float path is
        # vectorised differently per CPU (AVX2 vs scalar) and may differ in the last bit; integer
        # draws from the Mersenne Twister and the exact conversion below are the same everywhere.
        ints = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int64)
        unit = ints.to(torch.float32) / float(1 << 23) - 1.0  # exact, in [-1, 1)
        return unit * (scale * 3**0.5)

    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": uniform(config.vocab_size, h, scale=1.0)
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "self_attn.q_proj.weight"] = uniform(config.q_size, h)
        weights[p + "self_attn.k_proj.weight"] = uniform(config.kv_size, h)
        weights[p + "self_attn.v_proj.weight"] = uniform(config.kv_size, h)
        weights[p + "self_attn.o_proj.weight"] = uniform(h, config.q_size, scale=out_std)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
        weights[p + "mlp.gate_proj.weight"] = uniform(inter, h)
        weights[p + "mlp.up_proj.weight"] = uniform(inter, h)
        weights[p + "mlp.down_proj.weight"] = uniform(h, inter, scale=out_std)
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = uniform(config.vocab_size, h)
    return weights
