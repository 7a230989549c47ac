"""Sampling options through a real mesh with speculative decoding on, with the official ``openai``
client: every reply equals the offline engine's run of the same options, token for token, with
logprobs within float tolerance, streamed and not; short prompts are prefilled by the decode
worker, long ones by the prefill worker (its first token sampled there under the same options).

One mesh (kv-registry, router, prefill, decode and an n-gram draft worker as processes on a
real nats-server) serves every case.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from kvmesh.loadgen.bench_spec import DraftSetup, spec_mesh
from kvmesh.shared.text.sampling import SamplingOptions

from kvmesh.testing.mesh import random_prompts

pytestmark = pytest.mark.slow

MODEL = "kvmesh-tiny"
ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "512"}
LOCAL_PREFILL_BELOW = 48
# phrases repeated three times: n-gram drafts find something to propose
PROMPTS = [p * 3 for p in random_prompts(2, 10, 12, seed=3)] + [
    p * 3 for p in random_prompts(2, 30, 40, seed=4)
]
# HTTP body -> the options the engine must run
CASES = {
    "penalties-greedy": (
        {
            "temperature": 0,
            "max_tokens": 16,
            "logprobs": 3,
            "extra_body": {
                "repetition_penalty": 1.3,
                "ignore_eos": True,
                "logit_bias": {"101": 3.0, "32": -100},
            },
            "frequency_penalty": 0.4,
            "presence_penalty": 0.3,
        },
        SamplingOptions(
            max_tokens=16,
            temperature=0,
            logprobs=3,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            logit_bias={101: 3.0, 32: -100},
            ignore_eos=True,
        ),
    ),
    "seeded-min-p-min-tokens": (
        {
            "temperature": 0.8,
            "max_tokens": 14,
            "seed": 21,
            "logprobs": 2,
            "extra_body": {"top_k": 30, "min_p": 0.05, "min_tokens": 10, "stop_token_ids": [97]},
        },
        SamplingOptions(
            max_tokens=14,
            temperature=0.8,
            seed=21,
            logprobs=2,
            top_k=30,
            min_p=0.05,
            min_tokens=10,
            stop_token_ids=(97,),
        ),
    ),
    "greedy-logprobs": (
        {"temperature": 0, "max_tokens": 20, "logprobs": 1, "extra_body": {"ignore_eos": True}},
        SamplingOptions(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True),
    ),
}


@pytest.fixture(scope="module")
def mesh():
    with spec_mesh(
        DraftSetup("ngram", k=4), env=ENV, local_prefill_threshold=LOCAL_PREFILL_BELOW
    ) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def offline(tiny):
    """The offline engine's tokens and logprobs of each case and prompt."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=512))
    out = {}
    for name, (_, params) in CASES.items():
        for i, prompt in enumerate(PROMPTS):
            engine.add_request("r", prompt, params)
            outs = []
            while engine.has_unfinished():
                outs += engine.step()
            ids = [t for o in outs for t in o.new_token_ids]
            lps = [lp for o in outs for lp in o.logprobs or ()]
            out[name, i] = (ids, lps, tokenizer)
    return out


def expected_texts(ids, tokenizer) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


@pytest.mark.parametrize("name", list(CASES))
def test_options_equal_the_offline_engine_with_drafts_streamed_and_not(mesh, offline, name):
    body, _ = CASES[name]

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="x", max_retries=0)
        async with client:
            fulls = await asyncio.gather(
                *(client.completions.create(model=MODEL, prompt=p, **body) for p in PROMPTS)
            )
            streams = []
            for p in PROMPTS:
                stream = await client.completions.create(model=MODEL, prompt=p, stream=True, **body)
                streams.append([c async for c in stream])
        return fulls, streams

    fulls, streams = asyncio.run(scenario())
    accepted = 0
    for i, (full, chunks) in enumerate(zip(fulls, streams, strict=True)):
        ids, lps, tokenizer = offline[name, i]
        choice = full.choices[0]
        assert choice.logprobs.tokens == expected_texts(ids, tokenizer), (name, i)
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
        tops = [set(d) for d in choice.logprobs.top_logprobs]
        assert tops == [
            {tokenizer.decode([t], skip_special_tokens=False) for t in (*lp.top_ids, tok)}
            for tok, lp in zip(ids, lps, strict=True)
        ]
        assert full.usage.completion_tokens == len(ids)
        details = full.usage.completion_tokens_details
        accepted += details.accepted_prediction_tokens if details else 0
        streamed = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens
        ]
        assert streamed == choice.logprobs.tokens
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        offsets = [
            o
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset
        ]
        assert offsets == choice.logprobs.text_offset
    if name == "greedy-logprobs":
        assert accepted > 0  # the drafts were verified and kept


def test_chat_logprobs_and_stop_string_kept_through_the_mesh(mesh):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="x", max_retries=0)
        async with client:
            messages = [{"role": "user", "content": "the mesh decode prefill " * 4}]
            plain = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=12,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
            text = plain.choices[0].message.content
            stop = text[3:5]
            kept = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=12,
                temperature=0,
                stop=[stop],
                extra_body={"include_stop_str_in_output": True},
            )
            return plain, kept, text, stop

    plain, kept, text, stop = asyncio.run(scenario())
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == text
    assert kept.choices[0].message.content == text[: text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def offline_choices(tiny, prompt, params):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=512))
    engine.add_request("r", prompt, params)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
    return got, tokenizer


@pytest.mark.parametrize("prompt_index", [0, 2], ids=["local-prefill", "remote-prefill"])
def test_n_choices_equal_the_offline_engines_streamed_and_not(mesh, tiny, prompt_index):
    prompt = PROMPTS[prompt_index]
    params = SamplingOptions(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    expected, tokenizer = offline_choices(tiny, prompt, params)
    body = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3, "logprobs": 0}

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="x", max_retries=0)
        async with client:
            full = await client.completions.create(
                model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **body
            )
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, stream=True, extra_body={"ignore_eos": True}, **body
            )
            return full, [c async for c in stream]

    full, chunks = asyncio.run(scenario())
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    for choice in full.choices:
        texts = [tokenizer.decode([t], skip_special_tokens=False) for t in expected[choice.index]]
        assert choice.logprobs.tokens == texts, choice.index
        streamed = "".join(
            c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index
        )
        assert streamed == choice.text
        finishes = [
            c.choices[0].finish_reason
            for c in chunks
            if c.choices and c.choices[0].index == choice.index
        ]
        assert finishes[-1] == "length" and finishes.count("length") == 1
    assert full.usage.completion_tokens == 36


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "count", "tag"],
}


def test_structured_outputs_through_the_mesh_with_the_openai_client(mesh):
    import json
    import re

    from jsonschema import Draft202012Validator

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="x", max_retries=0)
        async with client:
            messages = [{"role": "user", "content": "the mesh decode prefill " * 4}]
            schema_format = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            }
            chats = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_completion_tokens=60,
                        seed=s,
                        response_format=schema_format,
                    )
                    for s in range(6)
                ),
                client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_completion_tokens=60,
                    seed=9,
                    response_format={"type": "json_object"},
                    n=2,
                ),
            )
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=60,
                seed=3,
                response_format=schema_format,
                stream=True,
            )
            streamed = "".join(
                [c.choices[0].delta.content or "" async for c in stream if c.choices]
            )
            regex = await client.completions.create(
                model=MODEL,
                prompt=PROMPTS[2],
                max_tokens=20,
                seed=1,
                extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
            )
            choice = await client.completions.create(
                model=MODEL,
                prompt=PROMPTS[0],
                max_tokens=20,
                seed=1,
                extra_body={"guided_choice": ["alpha", "beta"]},
            )
            with pytest.raises(openai.BadRequestError, match="Unsupported type"):
                await client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "foo"}},
                    },
                )
            return chats, streamed, regex, choice

    chats, streamed, regex, choice = asyncio.run(scenario())
    validator = Draft202012Validator(SCHEMA)
    for reply in chats[:-1]:
        validator.validate(json.loads(reply.choices[0].message.content))
        assert reply.choices[0].finish_reason == "stop"
    validator.validate(json.loads(streamed))
    for c in chats[-1].choices:  # any object; one the length limit cut does not parse
        assert c.message.content.startswith("{")
        assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    assert choice.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("prompt_index", [0, 2], ids=["local-prefill", "remote-prefill"])
def test_echo_with_logprobs_and_prompt_logprobs_score_the_prompt_as_offline(
    mesh, tiny, prompt_index
):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    prompt = PROMPTS[prompt_index]
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=512))
    params = SamplingOptions(max_tokens=4, temperature=0, prompt_logprobs=1, ignore_eos=True)
    engine.add_request("r", prompt, params)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or out.prompt_logprobs
    assert first is not None

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="x", max_retries=0)
        async with client:
            kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            extra = {"ignore_eos": True}
            full = await client.completions.create(
                echo=True, logprobs=1, extra_body=extra, **kwargs
            )
            stream = await client.completions.create(
                echo=True, logprobs=1, stream=True, extra_body=extra, **kwargs
            )
            chunks = [c async for c in stream]
            scored = await client.completions.create(
                extra_body={**extra, "prompt_logprobs": 1}, **kwargs
            )
            return full, chunks, scored

    full, chunks, scored = asyncio.run(scenario())
    choice = full.choices[0]
    prompt_text = tokenizer.decode(prompt)
    assert choice.text.startswith(prompt_text)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
        [lp.logprob for lp in first], abs=1e-4
    )
    assert len(choice.logprobs.tokens) == len(prompt) + 4
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    vllm = scored.choices[0].model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt)
    for entry, token, lp in zip(vllm[1:], prompt[1:], first, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == lp.rank


def test_options_in_colocated_mode_equal_the_offline_engine(tiny):
    """The colocated baseline runs the same options: n seeded choices with logprobs and
    penalties, and a JSON schema."""
    import json

    from jsonschema import Draft202012Validator

    from kvmesh.testing.mesh import local_mesh

    prompt = PROMPTS[2]
    params = SamplingOptions(
        max_tokens=10, temperature=0.8, seed=2, n=2, repetition_penalty=1.2, ignore_eos=True
    )
    expected, tokenizer = offline_choices(tiny, prompt, params)

    async def scenario(url: str):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        async with client:
            plain = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=10,
                temperature=0.8,
                seed=2,
                n=2,
                logprobs=0,
                extra_body={"repetition_penalty": 1.2, "ignore_eos": True},
            )
            schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
            structured = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                seed=1,
                max_completion_tokens=60,
                response_format=schema_format,
            )
            return plain, structured

    with local_mesh("colocated", env=ENV) as mesh:
        plain, structured = asyncio.run(scenario(mesh.url))
    for choice in plain.choices:
        texts = [tokenizer.decode([t], skip_special_tokens=False) for t in expected[choice.index]]
        assert choice.logprobs.tokens == texts
    Draft202012Validator(SCHEMA).validate(json.loads(structured.choices[0].message.content))
