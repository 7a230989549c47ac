"""kvmesh's Llama-family model against transformers, through the paged KV cache."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model import kv_cache_spec, load_model
from kvmesh.shared.model.attention import AttentionMetadata
from support.hf_fixtures import (
    BLOCK_SIZE,
    greedy_generate,
    load_hf_reference,
    make_llama_checkpoint,
    make_mistral_checkpoint,
    prefill_logits,
    prefill_metadata,
)

PROMPT = "The quick brown fox jumps over the lazy dog; größer 🦊 " * 2  # 120 byte tokens: 8 blocks
# Blocks deliberately out of order, so a mix-up of block tables and slots changes the result.
TABLE_A = [7, 2, 11, 5, 13, 1, 8, 20, 17, 3]
TABLE_B = [4, 6, 9, 14]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_checkpoints):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        **hf_checkpoints,
        "mistral": make_mistral_checkpoint(root),
        "llama_biases": make_llama_checkpoint(
            root, name="llama_biases", attention_bias=True, mlp_bias=True
        ),
        "linear": make_llama_checkpoint(
            root, name="linear", rope_scaling={"rope_type": "linear", "factor": 4.0}
        ),
        "dynamic": make_llama_checkpoint(
            root,
            name="dynamic",
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            max_position_embeddings=64,
        ),
        "llama_v4_keys": v4_style_config(make_llama_checkpoint(root, name="llama_v4_keys")),
    }


def v4_style_config(path):
    """Rewrite config.json the way transformers 4.x wrote it: rope_theta + rope_scaling{"type"}."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    config["torch_dtype"] = config.pop("dtype")
    (path / "config.json").write_text(json.dumps(config))
    return path


def new_pool(model, num_blocks=32):
    return KVPool(kv_cache_spec(model.config, BLOCK_SIZE), num_blocks)


def hf_logits(ref, ids):
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "mistral", "llama_biases", "linear", "dynamic", "llama_v4_keys"]
)
def test_prefill_logits_match_transformers(checkpoints, name):
    model, tok = load_model(str(checkpoints[name]))
    if name == "llama_v4_keys":
        assert model.config.rope_type == "llama3" and model.config.rope_theta == 500000.0
    ids = tok.encode(PROMPT)[: model.config.max_position_embeddings]
    assert len(ids) > 3 * BLOCK_SIZE
    logits = prefill_logits(model, ids, new_pool(model), TABLE_A)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(
        logits, hf_logits(load_hf_reference(checkpoints[name]), ids), rtol=0, atol=1e-4
    )


def test_chunked_prefill_and_packed_batch_match_transformers(checkpoints):
    model, tok = load_model(str(checkpoints["llama"]))
    ref = load_hf_reference(checkpoints["llama"])
    a = tok.encode(PROMPT)
    b = tok.encode("A second, shorter prompt that shares the batch.")
    pool = new_pool(model)
    table_a, table_b = TABLE_A, TABLE_B
    with torch.inference_mode():
        # chunk 1 of a: its first 48 tokens alone
        model(torch.tensor(a[:48]), torch.arange(48), pool, prefill_metadata(48, table_a))
        # then the rest of a packed with all of b in one forward
        rest = len(a) - 48
        ids = torch.tensor(a[48:] + b)
        positions = torch.cat([torch.arange(48, len(a)), torch.arange(len(b))])
        tables = torch.zeros(2, len(table_a), dtype=torch.int64)
        tables[0], tables[1, : len(table_b)] = torch.tensor(table_a), torch.tensor(table_b)
        slots_a = prefill_metadata(rest, table_a, start=48).slot_mapping
        slots_b = prefill_metadata(len(b), table_b).slot_mapping
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slots_a, slots_b]),
            query_lens=[rest, len(b)],
            context_lens=torch.tensor([len(a), len(b)]),
            block_tables=tables,
            block_size=BLOCK_SIZE,
        )
        logits = model.compute_logits(model(ids, positions, pool, meta))
    torch.testing.assert_close(logits[:rest], hf_logits(ref, a)[48:], rtol=0, atol=1e-4)
    torch.testing.assert_close(logits[rest:], hf_logits(ref, b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_decode_reproduces_transformers_generate(checkpoints, name):
    model, tok = load_model(str(checkpoints[name]))
    ref = load_hf_reference(checkpoints[name])
    ids = tok.encode(PROMPT)[:70]
    num_new = 24
    with torch.inference_mode():
        expected = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert len(expected) == num_new
    got = greedy_generate(model, ids, num_new, new_pool(model), block_table=TABLE_B + TABLE_A)
    assert got == expected
    assert len(set(got)) > 1  # a degenerate checkpoint would make this test vacuous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_stays_close_to_float32(checkpoints, dtype):
    model, tok = load_model(str(checkpoints["llama"]), dtype=dtype)
    assert model.config.torch_dtype == dtype
    assert all(p.dtype == dtype for p in model.parameters())
    assert model.rope_cos.dtype == torch.float32
    ids = tok.encode(PROMPT)
    pool = KVPool(kv_cache_spec(model.config, BLOCK_SIZE), 16)
    assert pool.tensor.dtype == dtype
    logits = prefill_logits(model, ids, pool, list(range(8)))
    assert logits.dtype == torch.float32
    expected = hf_logits(load_hf_reference(checkpoints["llama"]), ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.1 * expected.abs().max().item())


def test_half_precision_checkpoint_loads_in_its_own_dtype(tmp_path):
    path = make_llama_checkpoint(tmp_path, dtype=torch.bfloat16)
    ref = load_hf_reference(path, dtype=torch.bfloat16)
    ref.save_pretrained(path)  # weights on disk in bf16, config.json says so
    model, _ = load_model(str(path))
    assert model.config.torch_dtype == torch.bfloat16 and model.config.dtype == "bfloat16"
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(model.tok_embeddings.weight, ref.model.embed_tokens.weight)


def test_kv_cache_spec_follows_config(tiny):
    model, _ = tiny
    spec = kv_cache_spec(model.config, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        4,
        2,
        64,
        torch.float32,
    )
    assert spec.block_bytes == 64 * 1024  # docs/ARCHITECTURE.md: 64 KiB per 16-token block
    assert kv_cache_spec(model.config, 32, torch.bfloat16).bytes_per_token == 2 * 1024
