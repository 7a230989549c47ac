"""load_model: sharded checkpoints, harmless extras, and every bad-input error naming its file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from kvmesh.shared.model import ModelLoadError, load_model
from support.hf_fixtures import make_llama_checkpoint, make_qwen2_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, hf_checkpoints):
    root = tmp_path_factory.mktemp("pristine")
    sharded = make_llama_checkpoint(root, name="sharded", max_shard_size="40KB")
    return {**hf_checkpoints, "sharded": sharded}


@pytest.fixture
def llama(pristine, tmp_path):
    """A private copy of the Llama checkpoint, free to break."""
    return shutil.copytree(pristine["llama"], tmp_path / "llama")


def rewrite_weights(path, change):
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_same_weights_as_single_file(pristine):
    index = json.loads((pristine["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded, _ = load_model(str(pristine["sharded"]))
    single, _ = load_model(str(pristine["llama"]))
    for (name, a), (_, b) in zip(
        sharded.state_dict().items(), single.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_qwen2_eos_ids_merge_config_generation_config_and_tokenizer(pristine):
    model, tok = load_model(str(pristine["qwen2"]))
    assert set(model.config.eos_token_ids) == tok.eos_token_ids == {256, 258}
    assert tok.bos_token_id is None and model.config.tie_word_embeddings


def test_missing_directory_is_reported(tmp_path):
    with pytest.raises(
        ModelLoadError,
        match=rf"{tmp_path / 'nope'}: no such checkpoint directory.*downloads nothing",
    ):
        load_model(str(tmp_path / "nope"))


def test_missing_config_json_is_reported(llama):
    (llama / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=rf"{llama / 'config.json'}: file not found"):
        load_model(str(llama))


def test_bad_config_json_is_reported(llama):
    (llama / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=rf"{llama / 'config.json'}: invalid JSON"):
        load_model(str(llama))


def test_unknown_architecture_is_reported(llama):
    rewrite_config(llama, architectures=["GemmaForCausalLM"])
    with pytest.raises(
        ModelLoadError,
        match=r"config\.json: architecture 'GemmaForCausalLM' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
    ):
        load_model(str(llama))


def test_missing_weight_tensor_is_named(llama):
    rewrite_weights(llama, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing weight tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model(str(llama))


def test_shape_mismatch_names_tensor_and_both_shapes(llama):
    def shrink(w):
        w["model.layers.0.self_attn.k_proj.weight"] = w["model.layers.0.self_attn.k_proj.weight"][
            :16
        ].clone()

    rewrite_weights(llama, shrink)
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 64\), expected \(32, 64\)",
    ):
        load_model(str(llama))


def test_unknown_extra_tensor_is_refused(llama):
    rewrite_weights(
        llama, lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    )
    with pytest.raises(
        ModelLoadError,
        match=r"unexpected weight tensors 'model\.layers\.0\.self_attn\.q_norm\.weight'",
    ):
        load_model(str(llama))


def test_rotary_inv_freq_extra_is_ignored(llama, pristine):
    rewrite_weights(
        llama, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    )
    model, _ = load_model(str(llama))
    reference, _ = load_model(str(pristine["llama"]))
    assert torch.equal(
        model.layers[0].attention.wqkv.weight, reference.layers[0].attention.wqkv.weight
    )


def test_index_referencing_missing_shard_is_reported(pristine, tmp_path):
    path = shutil.copytree(pristine["sharded"], tmp_path / "sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors\.index\.json: references shard '{shard}'"
    ):
        load_model(str(path))


def test_missing_weights_file_is_reported(llama):
    (llama / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError,
        match=r"no weights: expected model\.safetensors or model\.safetensors\.index\.json",
    ):
        load_model(str(llama))


def test_missing_tokenizer_is_reported(llama):
    (llama / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=rf"{llama / 'tokenizer.json'}: file not found"):
        load_model(str(llama))


def test_tokenizer_larger_than_embeddings_is_refused(llama):
    rewrite_config(llama, vocab_size=258)
    with pytest.raises(
        ModelLoadError,
        match=r"tokenizer\.json: the tokenizer has 260 tokens but config\.json's vocab_size is 258",
    ):
        load_model(str(llama))


def test_active_sliding_window_is_refused(tmp_path):
    path = make_qwen2_checkpoint(
        tmp_path, use_sliding_window=True, sliding_window=32, max_window_layers=0
    )
    with pytest.raises(
        ModelLoadError, match=r"config\.json: sliding-window attention \(sliding_window=32"
    ):
        load_model(str(path))


def test_unsupported_dtype_argument_is_refused(pristine):
    with pytest.raises(
        ModelLoadError, match=r"load_model\(dtype=\.\.\.\): dtype torch\.float64 is not supported"
    ):
        load_model(str(pristine["llama"]), dtype=torch.float64)


def test_config_and_tokenizer_load_without_weights_with_every_eos_id(tmp_path):
    from kvmesh.shared.model import load_config_and_tokenizer

    path = make_qwen2_checkpoint(tmp_path)
    _, full_tokenizer = load_model(str(path))
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    config, tokenizer = load_config_and_tokenizer(str(path))
    assert set(config.eos_token_ids) == {256, 258}  # config.json + generation_config.json
    assert tokenizer.eos_token_ids == full_tokenizer.eos_token_ids
