"""``kvmesh model seeded``: a seeded checkpoint of any shape that kvmesh and transformers both load,
the same bits from the same seed, greedy tokens equal to transformers', clear errors."""

import hashlib

import pytest
import torch
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.model import load_model
from kvmesh.shared.model.seeded import num_parameters, write_seeded_checkpoint
from kvmesh.shared.text.sampling import SamplingOptions
from support.hf_fixtures import load_hf_reference
from support.small_models import small_shape

from kvmesh.cli import main

SMALL = small_shape()


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_seeded_checkpoint_is_the_same_bits_for_a_seed_and_differs_across_seeds(tmp_path):
    write_seeded_checkpoint(tmp_path / "a", SMALL, seed=1)
    write_seeded_checkpoint(tmp_path / "b", SMALL, seed=1)
    write_seeded_checkpoint(tmp_path / "c", SMALL, seed=2)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")


def test_seeded_checkpoint_greedy_tokens_equal_transformers(tmp_path):
    path = tmp_path / "m"
    config = write_seeded_checkpoint(path, SMALL, seed=5)
    model, tokenizer = load_model(str(path))
    ref = load_hf_reference(path)
    assert sum(p.numel() for p in ref.parameters()) == num_parameters(config)
    prompt = tokenizer.encode("The seeded model speaks bytes: ünïcödé too.")
    assert prompt[0] == config.bos_token_id
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, ref(input_ids=ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    expected = ids[0, len(prompt) :].tolist()
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=32))
    greedy = SamplingOptions(max_tokens=10, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], greedy) == [expected]
    assert tokenizer.decode(tokenizer.encode("héllo", add_special_tokens=False)) == "héllo"


def test_seeded_command_writes_the_default_shape_and_refuses_a_used_folder(tmp_path, capsys):
    path = tmp_path / "m23"
    assert main(["model", "seeded", str(path), "--num-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "hidden 512, 1 layers, 8 heads / 2 KV heads" in out
    with pytest.raises(SystemExit, match=r"already holds config\.json, model\.safetensors"):
        main(["model", "seeded", str(path)])
    with pytest.raises(SystemExit, match="num_attention_heads"):
        main(["model", "seeded", str(tmp_path / "bad"), "--num-heads", "6", "--num-kv-heads", "4"])
