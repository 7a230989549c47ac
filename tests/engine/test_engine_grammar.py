"""Structured outputs in the engine (xgrammar): outputs that parse and validate against their
schema, regexes and choices honoured, grammars compiled once, and speculative verification
lossless under a grammar, a forbidden draft token rejected."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputs, json_schema_text
from support.engine_handoff import prefill_handoff
from support.engine_runs import new_tokens, run_requests

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        },
    },
    "required": ["ok", "count", "tag", "items"],
}
JSON = StructuredOutputs(json=json_schema_text(SCHEMA))


def engine(tiny, kv_buffer=None, **kw) -> LLMEngine:
    model, tok = tiny
    kw.setdefault("num_blocks", 512)
    return LLMEngine(model, tok, EngineConfig(**kw), kv_buffer=kv_buffer)


def run(eng, prompts, params, drafter=None):
    """Each request's tokens and finish reason, and the drafts accepted in all."""
    per_request = run_requests(eng, prompts, params, drafter)
    reasons = [next(o.finish_reason for o in outs if o.finished) for outs in per_request]
    accepted = sum(o.accepted_drafts for outs in per_request for o in outs)
    return [new_tokens(outs) for outs in per_request], reasons, accepted


def test_fifty_json_outputs_parse_and_validate_against_their_schema(tiny):
    eng = engine(tiny)
    prompts = [[(7 * i + j) % 256 for j in range(5 + i % 7)] for i in range(50)]
    params = [
        SamplingOptions(max_tokens=100, temperature=1.0, seed=i, structured_outputs=JSON)
        for i in range(50)
    ]
    outs, reasons, _ = run(eng, prompts, params)
    validator = Draft202012Validator(SCHEMA)
    texts = [eng.tokenizer.decode(ids) for ids in outs]
    for text, reason in zip(texts, reasons, strict=True):
        assert reason == "stop", text
        validator.validate(json.loads(text))
    assert len(set(texts)) > 10  # sampled, not one fixed answer
    assert eng.grammars.num_compiled == 1  # fifty requests, one compiled grammar


def test_regex_choice_grammar_and_json_object(tiny):
    eng = engine(tiny)
    cases = [
        (StructuredOutputs(regex="[0-9]{3}-[a-z]{2}"), re.compile("[0-9]{3}-[a-z]{2}").fullmatch),
        (
            StructuredOutputs(choice=("yes", "no", 'maybe "so"')),
            {"yes", "no", 'maybe "so"'}.__contains__,
        ),
        (StructuredOutputs(grammar='root ::= "(" [ab]+ ")"'), re.compile(r"\([ab]+\)").fullmatch),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, ok in cases:
        params = [
            SamplingOptions(max_tokens=60, temperature=0.8, seed=s, structured_outputs=spec)
            for s in range(4)
        ]
        outs, reasons, _ = run(eng, [[1, 2, 3]] * 4, params)
        for ids, reason in zip(outs, reasons, strict=True):
            text = eng.tokenizer.decode(ids)
            if spec.json_object and reason == "length":
                continue  # an object the length limit cut: nothing to parse
            assert reason == "stop" and ok(text), (spec, text)


def test_a_grammar_that_does_not_build_is_a_request_error(tiny):
    with pytest.raises(RequestError, match="Unclosed"):
        engine(tiny).add_request(
            "r", [1], SamplingOptions(structured_outputs=StructuredOutputs(regex="[a-"))
        )


def forbidden_then_right(reference: list[list[int]], k: int):
    """Chains whose first token is the right one and the rest forbidden by the grammar ('~' is
    no JSON token here) or right, alternately."""

    def drafter(rid: str, done: list[int]) -> DraftTree | None:
        ref = reference[int(rid[1:])]
        nxt = ref[len(done) : len(done) + k]
        if not nxt:
            return None
        if len(done) % 2:
            nxt = [nxt[0], *([ord("~")] * (len(nxt) - 1))]
        return DraftTree.chain(nxt)

    return drafter


def test_drafts_under_a_grammar_are_lossless_and_forbidden_ones_rejected(tiny):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = [
        SamplingOptions(max_tokens=30, temperature=0.9, seed=4, structured_outputs=JSON),
        SamplingOptions(max_tokens=30, temperature=0, structured_outputs=JSON),
    ]
    expected, _, _ = run(engine(tiny), prompts, params)
    got, _, accepted = run(engine(tiny), prompts, params, forbidden_then_right(expected, 4))
    assert got == expected
    assert accepted > 0
    assert all(ord("~") not in ids for ids in got)


def test_n_choices_each_follow_the_grammar(tiny):
    eng = engine(tiny)
    eng.add_request(
        "r", [1, 2, 3], SamplingOptions(max_tokens=80, seed=1, n=3, structured_outputs=JSON)
    )
    out: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
    assert sorted(out) == [0, 1, 2]
    for ids in out.values():
        Draft202012Validator(SCHEMA).validate(json.loads(eng.tokenizer.decode(ids)))


def test_a_completed_grammar_wins_over_min_tokens(tiny):
    spec = StructuredOutputs(choice=("a",))
    params = SamplingOptions(max_tokens=10, temperature=0, min_tokens=5, structured_outputs=spec)
    outs, reasons, _ = run(engine(tiny), [[1, 2, 3]], params)
    assert reasons == ["stop"]
    assert engine(tiny).tokenizer.decode(outs[0]) == "a"


def test_the_prefill_side_samples_the_first_token_under_the_grammar(tiny):
    """Disaggregated: the prefill engine's first token obeys the grammar (the decode engine
    refuses one that breaks it), and the decode engine goes on from the grammar's state after
    it: the output equals one engine's, and validates."""
    ids = [(3 * j) % 256 for j in range(40)]
    params = SamplingOptions(max_tokens=80, temperature=1.0, seed=11, structured_outputs=JSON)
    (expected,), _, _ = run(engine(tiny), [ids], params)
    prefill = engine(tiny)
    decode = engine(tiny, kv_buffer=bytearray(512 * prefill.kv_pool.spec.block_bytes))
    chunks, reserved = prefill_handoff(prefill, decode, ids, params)
    first = chunks[-1].first_token
    assert chr(first) == "{"  # the grammar's only allowed first token
    with pytest.raises(RequestError, match="breaks its structured output"):
        decode.admit_prefilled("x", ids, list(reserved), ord("~"), params)
    decode.admit_prefilled("r", ids, reserved, first, params)
    rest = []
    while decode.has_unfinished():
        rest += [t for o in decode.step() for t in o.new_token_ids]
    assert [first, *rest] == expected
    Draft202012Validator(SCHEMA).validate(json.loads(decode.tokenizer.decode(expected)))


def test_a_schema_sent_again_is_not_compiled_again_and_the_cache_is_bounded(tiny):
    from kvmesh.shared.engine import grammar

    book = engine(tiny).grammars
    specs = [StructuredOutputs(regex=f"[a-z]{{{i}}}") for i in range(1, grammar.MAX_COMPILED + 2)]
    book.matcher(specs[0])
    book.matcher(specs[0])
    assert book.num_compiled == 1
    for spec in specs[1:]:
        book.matcher(spec)
    assert book.num_compiled == len(specs)
    book.matcher(specs[-1])  # still cached
    assert book.num_compiled == len(specs)
    book.matcher(specs[0])  # the least recently used: dropped when the 65th came in
    assert book.num_compiled == len(specs) + 1
