import hashlib

import pytest
import torch
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model import TINY_NAME, kv_cache_spec, load_model
from kvmesh.shared.model.tiny import tiny_config, tiny_state_dict

# sha256 over (name, raw float32 bytes) of every tensor, in name order. If this changes, every
# deployed prefill/decode pair built from different versions would disagree: treat it as a break.
TINY_WEIGHTS_SHA256 = "c2eee182183c8cb57e32ac3590ea4665f39430fb1f0945df4e0a5202486c7310"


def weights_digest(weights):
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_tiny_weights_are_bit_identical_to_the_published_digest():
    assert weights_digest(tiny_state_dict()) == TINY_WEIGHTS_SHA256


def test_tiny_model_is_bit_identical_on_every_load():
    first, _ = load_model(TINY_NAME)
    second, _ = load_model()
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tiny_config_is_a_few_million_parameter_llama():
    model, tok = load_model()
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 4)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (
        2,
        64,
        4096,
    )
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 6_000_000
    assert config.vocab_size == tok.vocab_size == 262
    assert set(config.eos_token_ids) == tok.eos_token_ids
    assert config.bos_token_id == tok.bos_token_id


def test_tiny_is_a_real_llama_checkpoint():
    transformers = pytest.importorskip("transformers")
    config = tiny_config()
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=config.rope_theta,
            tie_word_embeddings=False,
        )
    ).eval()
    hf.load_state_dict(tiny_state_dict(), strict=True)
    model, tok = load_model()
    ids = tok.encode_chat([{"role": "user", "content": "Tell me about paged attention, please."}])
    pool = KVPool(kv_cache_spec(model.config), 8)
    from support.hf_fixtures import prefill_logits

    ours = prefill_logits(model, ids, pool, [4, 0, 6, 2])
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_decode_steps_reproduce_prefill_logits():
    """Feeding a prompt token by token through the cache gives the logits of one big prefill."""
    from support.hf_fixtures import prefill_logits, prefill_metadata

    model, tok = load_model()
    ids = tok.encode("Paged KV: one span per block, all layers.")  # 42 tokens, 3 blocks
    n = len(ids)
    full = prefill_logits(model, ids, KVPool(kv_cache_spec(model.config), 8), [1, 3, 5, 7])
    with torch.inference_mode():
        pool = KVPool(kv_cache_spec(model.config), 8)
        steps = [
            model.compute_logits(
                model(
                    torch.tensor([ids[i]]),
                    torch.tensor([i]),
                    pool,
                    prefill_metadata(1, [1, 3, 5, 7], start=i),
                )
            )
            for i in range(n)
        ]
    torch.testing.assert_close(torch.cat(steps), full, rtol=0, atol=1e-4)
