import json

import pytest
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.text.sampling import SamplingOptions

from kvmesh.cli import main


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", "--model", "kvmesh-tiny", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_prints_generated_ids_and_text(capsys, tiny):
    out = run_json(capsys, "--prompt-ids", "1,2,3,4", "--max-tokens", "6", "--ignore-eos")
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=8))
    expected = engine.generate(
        [[1, 2, 3, 4]], SamplingOptions(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    assert out["token_ids"] == expected
    assert out["text"] == tok.decode(expected)  # as the router sends it, unfinished bytes too
    assert out["finish_reason"] == "length" and out["num_prompt_tokens"] == 4


def test_generate_seeded_sampling_is_repeatable(capsys):
    argv = (
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--temperature",
        "0.9",
        "--seed",
        "11",
        "--ignore-eos",
    )
    assert run_json(capsys, *argv)["token_ids"] == run_json(capsys, *argv)["token_ids"]


def test_generate_rejects_bad_prompt_ids(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "kvmesh-tiny", "--prompt-ids", "1,x", "--json"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_generate_reports_invalid_sampling_params(capsys):
    assert (
        main(["generate", "--model", "kvmesh-tiny", "--prompt", "hi", "--temperature", "-1"]) == 2
    )
    assert "temperature must be float >= 0" in capsys.readouterr().err


def test_generate_says_it_talks_to_no_mesh(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--nats-url", "nats://127.0.0.1:4222"])
    err = capsys.readouterr().err
    assert "runs the model in this process" in err and "/v1/completions" in err


def test_generate_defaults_to_the_model_kvmesh_up_serves():
    from kvmesh.cli import build_parser
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import DEFAULT_MODEL

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert args.model == DEFAULT_MODEL == UpConfig().model
