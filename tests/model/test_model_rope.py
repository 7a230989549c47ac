import pytest
import torch
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.rope import apply_rope, rope_cos_sin, rotation_tables

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

MAX_POS = 128
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
]


def configs(scaling):
    kwargs = dict(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
    )
    hf = LlamaConfig(**kwargs, rope_theta=50000.0, rope_scaling=scaling)
    ours = ModelConfig(
        architecture="LlamaForCausalLM",
        head_dim=32,
        rope_theta=50000.0,
        rope_scaling=scaling,
        **kwargs,
    )
    return hf, ours


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"] if s else "default")
def test_cos_sin_match_transformers_inside_context(scaling):
    hf_config, config = configs(scaling)
    positions = torch.arange(MAX_POS)[None]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(config, MAX_POS)
    assert torch.equal(torch.cat([cos, cos], -1), hf_cos[0])
    assert torch.equal(torch.cat([sin, sin], -1), hf_sin[0])


def test_scaling_changes_frequencies():
    base = rope_cos_sin(configs(None)[1], MAX_POS)[0]
    for scaling in (SCALINGS[1], SCALINGS[3]):
        assert not torch.allclose(rope_cos_sin(configs(scaling)[1], MAX_POS)[0], base)


def test_dynamic_ntk_beyond_context_matches_transformers_decode_steps():
    hf_config, config = configs({"rope_type": "dynamic", "factor": 2.0})
    hf_rope = LlamaRotaryEmbedding(hf_config)
    num_positions = MAX_POS + 40
    cos, sin = rope_cos_sin(config, num_positions)
    assert not torch.allclose(
        cos[MAX_POS + 10], rope_cos_sin(configs(None)[1], num_positions)[0][MAX_POS + 10]
    )
    # transformers grows the base at each decode step past the trained length
    for p in range(MAX_POS - 2, num_positions):
        hf_cos, hf_sin = hf_rope(torch.zeros(1), torch.tensor([[p]]))
        torch.testing.assert_close(cos[p], hf_cos[0, 0, :16], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[p], hf_sin[0, 0, :16], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_transformers_rotation(dtype):
    torch.manual_seed(0)
    hf_config, config = configs(SCALINGS[3])
    T = 40
    positions = torch.randint(0, MAX_POS, (T,))
    q = torch.randn(T, 4, 32, dtype=dtype)
    k = torch.randn(T, 2, 32, dtype=dtype)
    cos, sin = rotation_tables(*rope_cos_sin(config, MAX_POS))
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])
    # transformers works on (B, H, T, D)
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    cos, sin = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    assert torch.equal(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))
