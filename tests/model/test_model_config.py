import dataclasses
import json

import pytest
import torch
from kvmesh.shared.model.config import ModelConfig, ModelConfigError

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def parse(**changes):
    raw = {**BASE, **changes}
    return ModelConfig.from_dict(
        {k: v for k, v in raw.items() if v is not None}, source="ckpt/config.json"
    )


def test_head_dim_defaults_to_hidden_over_heads_and_explicit_value_wins():
    assert parse().head_dim == 16
    assert parse(head_dim=32).head_dim == 32


def test_classic_rope_keys_parse_like_v5_rope_parameters():
    classic = parse(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0})
    v5 = parse(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0})
    assert classic.rope_theta == v5.rope_theta == 500000.0
    assert classic.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert parse(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_scaling is None


def test_llama3_scaling_without_original_length_uses_max_position_embeddings():
    cfg = parse(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }
    )
    assert cfg.rope_scaling["original_max_position_embeddings"] == 512


def test_unknown_architecture_is_refused_naming_file_and_supported_ones():
    with pytest.raises(
        ModelConfigError,
        match=r"ckpt/config\.json.*GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM",
    ):
        parse(architectures=["GPT2LMHeadModel"])


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ModelConfigError, match=r"config\.json.*rope type 'yarn'"):
        parse(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_qwen2_always_has_qkv_bias_but_no_output_bias():
    cfg = parse(architectures=["Qwen2ForCausalLM"])
    assert cfg.attention_bias and not cfg.attention_out_bias
    llama = parse(attention_bias=True)
    assert llama.attention_bias and llama.attention_out_bias
    assert not parse().attention_bias


def test_eos_token_id_may_be_a_list():
    assert parse(eos_token_id=[1, 2]).eos_token_ids == (1, 2)
    assert parse(eos_token_id=3).eos_token_ids == (3,)


def test_dtype_is_read_from_either_key():
    assert parse(dtype="bfloat16").dtype == "bfloat16"
    assert parse(dtype="bfloat16").torch_dtype == torch.bfloat16
    assert parse(torch_dtype="float16").torch_dtype == torch.float16
    assert parse(torch_dtype="bf16").dtype == "bfloat16"  # the spellings seen in the wild
    with pytest.raises(ModelConfigError, match="float8"):
        parse(dtype="float8_e4m3fn")
    with pytest.raises(ModelConfigError, match="dtype None is not supported"):
        dataclasses.replace(parse(), dtype=None)  # only a checkpoint naming none means float32


def test_active_mistral_sliding_window_is_refused():
    with pytest.raises(ModelConfigError, match=r"config\.json.*sliding-window.*sliding_window=128"):
        parse(architectures=["MistralForCausalLM"], sliding_window=128)
    # A window as long as the context changes nothing.
    assert parse(architectures=["MistralForCausalLM"], sliding_window=512).num_hidden_layers == 2


def test_qwen2_sliding_window_is_refused_only_when_a_layer_uses_it():
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert parse(**qwen, use_sliding_window=False).vocab_size == 100
    with pytest.raises(ModelConfigError, match="sliding-window"):
        parse(**qwen, use_sliding_window=True, max_window_layers=1)
    with pytest.raises(ModelConfigError, match="sliding-window"):
        parse(**qwen, layer_types=["full_attention", "sliding_attention"])


def test_heads_must_divide_evenly_into_kv_groups():
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        parse(num_key_value_heads=3)


def test_missing_required_key_is_named():
    raw = {k: v for k, v in BASE.items() if k != "hidden_size"}
    with pytest.raises(ModelConfigError, match=r"config\.json: missing required key 'hidden_size'"):
        ModelConfig.from_dict(raw)


def test_from_file_reports_bad_json_with_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ModelConfigError, match=rf"{path}: invalid JSON"):
        ModelConfig.from_file(path)
    path.write_text(json.dumps(BASE))
    assert ModelConfig.from_file(path).source == str(path)
