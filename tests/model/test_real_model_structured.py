"""Structured outputs with the real default model, SmolLM2-135M-Instruct: twenty seeded chat
answers under a JSON schema (its 49,152-token BPE vocabulary given to xgrammar as each token's
bytes) all parse and validate, and a regex and a choice hold too.

The model is the one `kvmesh model fetch smollm2-135m-instruct` keeps in kvmesh's cache
(tests/model/test_real_model.py fetches it); where it is neither cached nor fetchable, these tests
skip and say so. About a minute on two cores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputs, json_schema_text

pytestmark = pytest.mark.slow

ANSWERS = 20  # four per question, each with its own seed

NAME = "smollm2-135m-instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "cold", "hot"]}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "coastal", "tags"],
}
QUESTIONS = [
    "Describe Paris as JSON.",
    "Give me a city in Japan, in JSON.",
    "Which city would you like to visit? Answer in JSON.",
    "Tell me about Oslo using JSON.",
    "Name a big city and describe it in JSON.",
]


def _model_dir() -> Path:
    try:
        from kvmesh.shared.model.fetch import IndexUnreachableError, fetch_model
    except ImportError:  # a checkout without `kvmesh model fetch`: the cache only
        cached = Path.home() / ".cache" / "kvmesh" / "models" / NAME
        if not (cached / "config.json").is_file():
            pytest.skip(f"{NAME} is not in {cached.parent} (kvmesh model fetch {NAME})")
        return cached
    try:
        return fetch_model(NAME, progress=lambda line: print(f"[real model] {line}"))
    except IndexUnreachableError as e:
        pytest.skip(f"{NAME} is not cached and cannot be fetched: {e}")


@pytest.fixture(scope="module")
def engine():
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.loader import load_model

    model, tokenizer = load_model(str(_model_dir()))
    return LLMEngine(model, tokenizer, EngineConfig(num_blocks=1024, max_num_seqs=64))


def _run(engine, prompts: list[list[int]], params: list[SamplingOptions]) -> list[tuple]:
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return [(engine.tokenizer.decode(out[rid]), reasons[rid]) for rid in ids]


def test_twenty_json_answers_of_the_real_model_parse_and_validate(engine):
    tok = engine.tokenizer
    spec = StructuredOutputs(json=json_schema_text(SCHEMA))
    prompts = [
        tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(ANSWERS)
    ]
    params = [
        SamplingOptions(max_tokens=120, temperature=0.8, seed=i, structured_outputs=spec)
        for i in range(ANSWERS)
    ]
    answers = _run(engine, prompts, params)
    validator = Draft202012Validator(SCHEMA)
    for text, reason in answers:
        assert reason == "stop", text
        validator.validate(json.loads(text))
    assert len({text for text, _ in answers}) > ANSWERS // 2  # sampled, not one fixed answer


def test_a_regex_and_a_choice_hold_for_the_real_model(engine):
    tok = engine.tokenizer
    ask = lambda q: tok.encode_chat([{"role": "user", "content": q}])
    date = StructuredOutputs(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}")
    colour = StructuredOutputs(choice=("red", "green", "blue"))
    params = [
        SamplingOptions(max_tokens=20, temperature=0.8, seed=s, structured_outputs=spec)
        for spec in (date, colour)
        for s in range(5)
    ]
    prompts = [ask("When did the Berlin wall fall?")] * 5 + [ask("Name a colour.")] * 5
    answers = _run(engine, prompts, params)
    for text, reason in answers[:5]:
        assert reason == "stop" and re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", text), text
    for text, reason in answers[5:]:
        assert reason == "stop" and text in ("red", "green", "blue"), text
