"""Pure tests of the router: request validation, error shapes, response and SSE chunk building,
metrics exposition, the OpenAPI document and the config (stop strings: test_text_stop.py)."""

from __future__ import annotations

import dataclasses

import msgspec
import orjson
import pytest
from kvmesh.services.router.api import (
    GenerateRequest,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import (
    ApiError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvmesh.services.router.logprobs import LogprobsBuilder
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.openapi import openapi_document
from kvmesh.services.router.prompt import tokenize
from kvmesh.services.router.responses import (
    SSE_DONE,
    ChoiceResult,
    ResponseBuilder,
    Usage,
    sse_event,
)
from kvmesh.services.router.timings import RequestTiming
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.messages.workers import (
    BlockPool,
    DataPlaneRefusals,
    DecodeAdvert,
    DecodeReach,
    WorkerLoad,
)
from kvmesh.shared.config.service_config import ConfigError, config_from_args
from kvmesh.shared.model.tiny import tiny_tokenizer
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs

MODEL = "kvmesh-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def completion(**body) -> GenerateRequest:
    return parse_completion({"model": MODEL, "prompt": "hi", **body}, MODEL)


def chat(**body) -> GenerateRequest:
    return parse_chat(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, MODEL
    )


def invalid(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# --- request parsing ---------------------------------------------------------------------------


def test_parse_json_body_refuses_invalid_json_with_invalid_json_code():
    err = invalid(parse_json_body, b"{not json")
    assert (err.status, err.code) == (400, "invalid_json")
    assert "not valid JSON" in err.message


def test_parse_json_body_refuses_a_json_array():
    err = invalid(parse_json_body, b"[1, 2]")
    assert err.status == 400 and "object" in err.message


def test_completion_accepts_text_and_token_ids():
    assert completion(prompt="hello").prompt_text == "hello"
    assert completion(prompt=[1, 2, 3]).prompt_ids == (1, 2, 3)
    assert completion(prompt=["one"]).prompt_text == "one"
    assert completion(prompt=[[4, 5]]).prompt_ids == (4, 5)


def test_completion_refuses_a_batch_of_prompts_naming_prompt():
    err = invalid(completion, prompt=["a", "b"])
    assert (err.status, err.param, err.code) == (400, "prompt", "unsupported_parameter")
    assert "batched prompts" in err.message


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], {"x": 1}])
def test_completion_refuses_malformed_prompts(prompt):
    err = invalid(parse_completion, {"model": MODEL, "prompt": prompt}, MODEL)
    assert (err.status, err.param) == (400, "prompt")


def test_missing_model_is_400_and_unknown_model_is_404():
    err = invalid(parse_completion, {"prompt": "x"}, MODEL)
    assert (err.status, err.param, err.code) == (400, "model", "missing_required_parameter")
    err = invalid(parse_completion, {"model": "gpt-4", "prompt": "x"}, MODEL)
    assert isinstance(err, ModelNotFoundError)
    assert (err.status, err.code) == (404, "model_not_found")
    assert MODEL in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("seed", 2**64),
        ("stream", "yes"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 3),
        ("n", 0),
        ("n", 17),
        ("best_of", 3),
        ("echo", "yes"),
        ("logprobs", 21),
        ("logprobs", True),
        ("presence_penalty", 2.5),
        ("frequency_penalty", "x"),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("stop_token_ids", [-1]),
        ("include_stop_str_in_output", 1),
        ("logit_bias", {"1": 500}),
        ("logit_bias", {"a": 5}),
        ("logit_bias", {"-1": 5}),
    ],
)
def test_invalid_parameter_is_400_naming_the_parameter(field, value):
    err = invalid(completion, **{field: value})
    assert err.status == 400
    assert err.param == field
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_sampling_parameters_are_carried():
    req = completion(temperature=0, top_p=0.5, top_k=7, seed=3, stop="\n", max_tokens=9)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 0.5, 7, 3)
    assert s.stop == ("\n",) and req.max_tokens == 9
    assert completion(top_k=0).sampling.top_k == 0
    assert completion(top_k=-1).sampling.top_k == 0  # both off
    assert completion(stop=["a", "b", "a"]).sampling.stop == ("a", "b")
    assert completion(n=1, stream=False).stream is False


def test_stream_options_need_stream_and_set_include_usage():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={}).include_usage
    err = invalid(completion, stream_options={"include_usage": True})
    assert err.param == "stream_options"


def test_chat_normalises_messages():
    req = parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
        },
        MODEL,
    )
    assert req.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
def test_chat_refuses_malformed_messages_naming_the_message(messages, param):
    err = invalid(parse_chat, {"model": MODEL, "messages": messages}, MODEL)
    assert (err.status, err.param) == (400, param)


def test_completion_takes_max_completion_tokens_like_chat():
    assert completion(max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert completion(max_tokens=9).max_tokens == 9


@pytest.mark.parametrize(
    ("param", "value", "expected"),
    [
        ("min_tokens", 3, 3),
        ("repetition_penalty", 1.2, 1.2),
        ("min_p", 0.05, 0.05),
        ("presence_penalty", -0.5, -0.5),
        ("frequency_penalty", 1.5, 1.5),
        ("stop_token_ids", [7, 9], (7, 9)),
        ("include_stop_str_in_output", True, True),
        ("logit_bias", {"7": -100, "12": 2.5}, {7: -100, 12: 2.5}),
    ],
)
def test_vllm_and_openai_sampling_options_are_carried(param, value, expected):
    for parse in (completion, chat):
        assert getattr(parse(**{param: value}).sampling, param) == expected


def test_logprobs_map_onto_the_options_on_both_routes():
    assert completion().sampling.logprobs is None
    assert completion(logprobs=0).sampling.logprobs == 0
    assert completion(logprobs=5).sampling.logprobs == 5
    assert chat().sampling.logprobs is None
    assert chat(logprobs=True).sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).sampling.logprobs == 4
    assert chat(logprobs=False).sampling.logprobs is None
    assert invalid(chat, top_logprobs=2).param == "top_logprobs"
    assert invalid(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"


def test_chat_prefers_max_completion_tokens_and_refuses_functions():
    assert chat(max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert chat(max_tokens=9).max_tokens == 9
    assert invalid(chat, functions=[{"name": "f"}]).param == "functions"
    assert invalid(chat, tools=[{"type": "function"}]).param == "tools[0].function"


# Found by tests/router/test_router_schema_fuzz.py: a value nested 1,000 lists deep (the JSON parser
# allows 1,024) overflowed the stack in the router (500) when an error message quoted its repr,
# or when the prompt parser unwrapped it recursively.
DEEP = 1000


def deeply_nested_body(name: str, **body) -> bytes:
    nested = b"[" * DEEP + b"1" + b"]" * DEEP
    return orjson.dumps(body)[:-1] + b',"' + name.encode() + b'":' + nested + b"}"


@pytest.mark.parametrize(
    "name", ["ignore_eos", "max_tokens", "temperature", "seed", "stop", "n", "logit_bias"]
)
def test_parameter_nested_1000_lists_deep_is_400_with_a_short_message(name):
    raw = deeply_nested_body(name, model=MODEL, prompt="hi", stream=True)
    err = invalid(parse_completion, parse_json_body(raw), MODEL)
    assert (err.status, err.param) == (400, name)
    assert "[[[[...]]]]" in err.message and len(err.message) < 300


def test_prompt_nested_1000_lists_deep_is_400_invalid_type():
    raw = deeply_nested_body("prompt", model=MODEL)
    err = invalid(parse_completion, parse_json_body(raw), MODEL)
    assert (err.status, err.param, err.code) == (400, "prompt", "invalid_type")
    assert "nests lists too deep" in err.message


def test_prompt_in_two_lists_is_refused_and_in_one_list_accepted():
    assert invalid(completion, prompt=[[[1, 2]]]).code == "invalid_type"
    assert invalid(completion, prompt=[["a"]]).code == "invalid_type"
    assert completion(prompt=[[1, 2]]).prompt_ids == (1, 2)


def test_chat_role_nested_1000_lists_deep_is_400_naming_the_role():
    raw = b'{"model":"%s","messages":[{"content":"x","role":%s}]}' % (
        MODEL.encode(),
        b"[" * DEEP + b"1" + b"]" * DEEP,
    )
    err = invalid(parse_chat, parse_json_body(raw), MODEL)
    assert (err.status, err.param) == (400, "messages[0].role")


def test_error_message_quotes_a_huge_value_cut_short():
    err = invalid(completion, logit_bias={"1": "x" * 100_000})
    assert err.param == "logit_bias" and len(err.message) < 300
    err = invalid(parse_completion, {"model": "m" * 100_000, "prompt": "hi"}, MODEL)
    assert err.status == 404 and len(err.message) < 300


# --- tokenize and context limits ---------------------------------------------------------------


def test_tokenize_completion_text_uses_bos_and_default_max_tokens(tokenizer):
    prompt = tokenize(completion(prompt="ab"), tokenizer, max_model_len=100)
    assert prompt.prompt_ids == (tokenizer.bos_token_id, ord("a"), ord("b"))
    assert prompt.sampling.max_tokens == 16


def test_tokenize_chat_applies_the_template_and_fills_the_context(tokenizer):
    prompt = tokenize(chat(), tokenizer, max_model_len=100)
    assert prompt.prompt_ids == tuple(tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    assert prompt.sampling.max_tokens == 100 - len(prompt.prompt_ids)


def test_tokenize_carries_sampling_options(tokenizer):
    req = completion(prompt=[1, 2], temperature=0.0, top_k=5, seed=11, stop=["x"], ignore_eos=True)
    s = tokenize(req, tokenizer, 100).sampling
    assert (s.temperature, s.top_k, s.seed, s.stop, s.ignore_eos) == (0.0, 5, 11, ("x",), True)


def test_prompt_plus_max_tokens_beyond_context_is_400_with_the_room_left(tokenizer):
    err = invalid(tokenize, completion(prompt=[1] * 10, max_tokens=95), tokenizer, 100)
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert "at most 90" in err.message
    err = invalid(tokenize, chat(max_completion_tokens=1000), tokenizer, 100)
    assert err.param == "max_completion_tokens"


def test_prompt_longer_than_context_is_400(tokenizer):
    err = invalid(tokenize, completion(prompt=[1] * 100), tokenizer, 100)
    assert (err.status, err.param) == (400, "prompt")
    assert "100 tokens" in err.message


def test_a_prompt_beyond_the_largest_kv_pool_is_400_naming_the_setting(tokenizer):
    err = invalid(tokenize, completion(prompt=[1] * 70), tokenizer, 100, 64)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "KV pool holds 64 tokens" in err.message and "--num-blocks" in err.message
    err = invalid(tokenize, completion(prompt=[1] * 10, max_tokens=60), tokenizer, 100, 64)
    assert err.param == "max_tokens" and "at most 54" in err.message
    assert tokenize(chat(), tokenizer, 100, 64).sampling.max_tokens < 64
    assert tokenize(completion(prompt=[1] * 70), tokenizer, 100, 4096)  # the model's limit


def test_pool_capacity_is_the_largest_live_pool_of_the_model():
    from kvmesh.services.router.pool_capacity import ADVERT_TTL_S, PoolCapacity

    def advert(worker, blocks, spec="m1"):
        return DecodeAdvert(
            worker_id=worker,
            mode="disagg",
            reach=DecodeReach(
                descriptor=None, block_bytes=64, block_size=16, kv_spec="kv", model_spec=spec
            ),
            load=WorkerLoad("ready", num_running=0, num_waiting=0),
            pool=BlockPool(total_blocks=blocks, free_blocks=blocks, free_block_ranges=()),
            sent_at=0.0,
        )

    capacity = PoolCapacity("m1")
    assert capacity.max_tokens(0.0) is None
    capacity.note(advert("d0", 10), 0.0)
    capacity.note(advert("d1", 30), 0.0)
    capacity.note(advert("other", 99, spec="m2"), 0.0)
    assert capacity.max_tokens(1.0) == 30 * 16
    capacity.forget("d1")
    assert capacity.max_tokens(1.0) == 10 * 16
    assert capacity.max_tokens(ADVERT_TTL_S + 1) is None


def test_stop_token_ids_and_logit_bias_must_be_in_the_vocabulary(tokenizer):
    assert invalid(tokenize, completion(stop_token_ids=[99999]), tokenizer, 100).param == (
        "stop_token_ids"
    )
    assert invalid(tokenize, chat(logit_bias={"99999": 1}), tokenizer, 100).param == "logit_bias"
    err = invalid(tokenize, completion(min_tokens=20, max_tokens=10), tokenizer, 100)
    assert err.param == "min_tokens"


def test_token_id_outside_vocabulary_is_400(tokenizer):
    err = invalid(tokenize, completion(prompt=[1, 99999]), tokenizer, 100)
    assert err.param == "prompt" and "99999" in err.message


def test_chat_messages_the_template_rejects_are_400(tokenizer):
    import copy

    strict = copy.copy(tokenizer)
    strict.chat_template, strict._template = "{{ raise_exception('no tool turns') }}", None
    req = parse_chat(
        {"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        MODEL,
    )
    err = invalid(tokenize, req, strict, 100)
    assert (err.status, err.param) == (400, "messages") and "no tool turns" in err.message


# --- errors ------------------------------------------------------------------------------------


def test_error_body_has_openai_shape():
    err = InvalidRequestError("bad", param="top_p")
    assert err.body() == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": "invalid_value",
        }
    }


def test_overloaded_error_rounds_retry_after_up():
    err = OverloadedError("full", retry_after_s=0.2)
    assert err.status == 429
    assert err.headers() == {"Retry-After": "1"}
    assert OverloadedError("full", retry_after_s=2.5).headers() == {"Retry-After": "3"}


def test_service_unavailable_error_retries_after_one_second_unless_told():
    err = ServiceUnavailableError("no decode worker")
    assert (err.status, err.code) == (503, "service_unavailable")
    assert err.headers() == {"Retry-After": "1"}
    assert ServiceUnavailableError("x", retry_after_s=4.2).headers() == {"Retry-After": "5"}


# --- responses and SSE -------------------------------------------------------------------------


def test_sse_event_framing():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def wire(body) -> dict:
    """A body as the router sends it."""
    return orjson.loads(msgspec.json.encode(body))


def test_completion_response_shape():
    b = ResponseBuilder("completion", "cmpl-1", MODEL, 7)
    body = b.full([ChoiceResult(0, "text", "length")], Usage(3, 4))
    assert wire(body) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": MODEL,
        "choices": [{"index": 0, "text": "text", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    assert b.role_chunk() is None
    assert wire(b.text_chunk("x"))["choices"][0] == {
        "index": 0,
        "text": "x",
        "logprobs": None,
        "finish_reason": None,
    }
    assert "usage" not in wire(b.text_chunk("x"))


def test_chat_chunks_open_with_role_and_end_with_finish_and_usage():
    b = ResponseBuilder("chat", "chatcmpl-1", MODEL, 7, include_usage=True)
    role = wire(b.role_chunk())
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"] is None
    assert wire(b.text_chunk("hi"))["choices"][0]["delta"] == {"content": "hi"}
    finish = wire(b.finish_chunk("stop"))["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    usage = wire(b.usage_chunk(Usage(2, 3)))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    full = wire(b.full([ChoiceResult(0, "hello", "stop")], Usage(2, 3)))
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hello"}


def test_every_streamed_and_full_body_matches_its_published_schema():
    """What the builder encodes validates against /openapi.json's schema of its route."""
    from jsonschema import Draft202012Validator

    doc = openapi_document(MODEL)

    def validator(name: str) -> Draft202012Validator:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return Draft202012Validator(schema)

    for kind, full, chunk in (
        ("completion", "TextCompletion", "TextCompletion"),
        ("chat", "ChatCompletion", "ChatCompletionChunk"),
    ):
        for include_usage in (False, True):
            b = ResponseBuilder(kind, "id-1", MODEL, 7, include_usage=include_usage)
            validator(full).validate(wire(b.full([ChoiceResult(0, "text", "stop")], Usage(1, 2))))
            chunks = [b.role_chunk(), b.text_chunk("x"), b.finish_chunk("length")]
            chunks.append(b.usage_chunk(Usage(1, 2)))
            lps = LogprobsBuilder(tiny_tokenizer(), kind == "chat")
            logprobs = lps.build([104, 105], [TokenLogprobs(-0.5, (104, 7), (-0.5, -2.0))] * 2)
            chunks.append(b.text_chunk("hi", 0, logprobs))
            with_logprobs = ChoiceResult(1, "hi", "stop", logprobs)
            validator(full).validate(wire(b.full([with_logprobs], Usage(1, 2))))
            for body in filter(None, chunks):
                validator(chunk).validate(wire(body))
    validator("Error").validate(InvalidRequestError("bad", param="top_p").body())


# --- metrics -----------------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_with_inclusive_bounds():
    m = RouterMetrics()
    for v in (0.05, 0.1, 0.5, 7.0):
        m.ttft.observe(v)
    name = "kvmesh_router_time_to_first_token_seconds"
    assert m.sample(f"{name}_bucket", le="0.1") == 2  # 0.1 itself counts in le="0.1"
    assert m.sample(f"{name}_bucket", le="1.0") == 3
    assert m.sample(f"{name}_bucket", le="+Inf") == 4
    assert m.sample(f"{name}_count") == 4 and m.sample(f"{name}_sum") == pytest.approx(7.65)


def test_request_timer_observes_ttft_itl_and_e2e():
    m = RouterMetrics()
    t = RequestTimer(m, arrived_at=100.0)
    t.on_tokens(100.5, 1)
    t.on_tokens(100.7, 2)  # two tokens after 0.2 s: 0.1 s each
    t.on_finish("length", num_prompt_tokens=4, num_output_tokens=3)
    sample = m.sample
    ttft = "kvmesh_router_time_to_first_token_seconds"
    assert (sample(f"{ttft}_count"), sample(f"{ttft}_sum")) == (1, 0.5)
    itl = "kvmesh_router_inter_token_latency_seconds"
    assert sample(f"{itl}_count") == 2 and sample(f"{itl}_sum") == pytest.approx(0.2)
    e2e = "kvmesh_router_e2e_request_latency_seconds"
    assert sample(f"{e2e}_count") == 1 and sample(f"{e2e}_sum") == pytest.approx(0.7)
    assert sample("kvmesh_router_finish_reason_total", reason="length") == 1
    assert sample("kvmesh_router_generation_tokens_total") == 3
    assert sample("kvmesh_router_prompt_tokens_total") == 4


def test_prefill_report_feeds_the_transfer_histograms():
    m = RouterMetrics()
    m.record_prefill(
        PrefillReport(
            "r",
            "p0",
            queue_s=0.01,
            compute_s=0.2,
            transfer_s=0.05,
            exposed_transfer_s=0.004,
            num_chunks=3,
        )
    )
    assert m.sample("kvmesh_router_prefill_queue_seconds_sum") == 0.01
    assert m.sample("kvmesh_router_prefill_compute_seconds_sum") == 0.2
    assert m.sample("kvmesh_router_kv_transfer_seconds_sum") == 0.05
    assert m.sample("kvmesh_router_kv_exposed_transfer_seconds_sum") == 0.004


def test_metrics_render_is_prometheus_text():
    m = RouterMetrics()
    m.requests.labels("/v1/completions", "200").inc()
    m.requests.labels("/v1/completions", "200").inc()
    m.requests.labels("/v1/chat/completions", "429").inc()
    m.ttft.observe(0.3)
    text = m.render()
    assert text.endswith("\n")
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="200"} 2' in text
    assert 'kvmesh_router_requests_total{endpoint="/v1/chat/completions",status="429"} 1' in text
    assert 'kvmesh_router_time_to_first_token_seconds_bucket{le="0.5"} 1' in text
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "prefill_queue_seconds",
        "prefill_compute_seconds",
        "kv_transfer_seconds",
        "kv_exposed_transfer_seconds",
    ):
        assert f"# TYPE kvmesh_router_{name} histogram" in text
    # Every sample line is `name{labels} value` with a numeric value.
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1].replace("+Inf", "inf"))


def test_metrics_mirror_each_decode_workers_refusals_until_it_is_gone():

    m = RouterMetrics()
    advert = DecodeAdvert(worker_id="decode-0", mode="disagg", reach=DecodeReach(descriptor=None, block_bytes=1024, block_size=16, kv_spec="spec"), load=WorkerLoad("ready", num_running=0, num_waiting=0), pool=BlockPool(total_blocks=8, free_blocks=8, free_block_ranges=((0, 8),)), sent_at=0.0, refusals=DataPlaneRefusals(refused_accesses=5, stray_immediates=2, forged_announcements=1))  # fmt: skip
    m.record_advert(advert)
    text = m.render()
    assert "# TYPE kvmesh_decode_refused_accesses_total counter" in text
    assert 'kvmesh_decode_refused_accesses_total{worker="decode-0"} 5' in text
    assert 'kvmesh_decode_stray_immediates_total{worker="decode-0"} 2' in text
    assert 'kvmesh_decode_forged_announcements_total{worker="decode-0"} 1' in text
    m.forget_worker("decode-0")
    assert 'worker="decode-0"' not in m.render()


# --- OpenAPI and config ------------------------------------------------------------------------


def test_openapi_document_covers_every_route_and_resolves_refs():
    doc = openapi_document(MODEL)
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/openapi.json",
        "/v1/kvmesh/timings",
    }
    timings = doc["paths"]["/v1/kvmesh/timings"]["get"]["responses"]["200"]
    row = timings["content"]["application/json"]["schema"]["properties"]["requests"]["items"]
    assert list(row["properties"]) == [f.name for f in dataclasses.fields(RequestTiming)]
    text = orjson.dumps(doc).decode()
    schemas = doc["components"]["schemas"]
    for ref in {part.split('"')[0] for part in text.split('"$ref":"#/components/schemas/')[1:]}:
        assert ref in schemas, ref


def test_router_config_from_env_and_validation():
    config = config_from_args(
        RouterConfig,
        None,
        {"KVMESH_PORT": "9000", "KVMESH_MODE": "colocated", "KVMESH_SERVED_MODEL_NAME": "m"},
    )
    assert (config.port, config.mode, config.model_id) == (9000, "colocated", "m")
    assert RouterConfig().model_id == MODEL
    with pytest.raises(ConfigError, match="token_timeout_s"):
        config_from_args(RouterConfig, None, {"KVMESH_TOKEN_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="worker_id"):
        config_from_args(RouterConfig, None, {"KVMESH_WORKER_ID": "router.1"})
    with pytest.raises(ConfigError, match="nats_url"):
        config_from_args(RouterConfig, None, {"KVMESH_NATS_URL": "http://x"})


def test_logprobs_take_openais_shapes():
    tok = tiny_tokenizer()  # ids 0..255 are bytes
    lps = [TokenLogprobs(-0.25, (104, 72), (-0.25, -1.5)), TokenLogprobs(-0.75, (105,), (-0.5,))]
    chat = wire(LogprobsBuilder(tok, is_chat=True).build([104, 106], lps))
    assert chat == {
        "content": [
            {
                "token": "h",
                "logprob": -0.25,
                "bytes": [104],
                "top_logprobs": [
                    {"token": "h", "logprob": -0.25, "bytes": [104]},
                    {"token": "H", "logprob": -1.5, "bytes": [72]},
                ],
            },
            {
                "token": "j",
                "logprob": -0.75,
                "bytes": [106],
                "top_logprobs": [{"token": "i", "logprob": -0.5, "bytes": [105]}],
            },
        ],
        "refusal": None,
    }
    builder = LogprobsBuilder(tok, is_chat=False)
    first = wire(builder.build([104, 106], lps))
    assert first == {
        "tokens": ["h", "j"],
        "token_logprobs": [-0.25, -0.75],
        "top_logprobs": [{"h": -0.25, "H": -1.5}, {"i": -0.5, "j": -0.75}],
        "text_offset": [0, 1],
    }
    assert wire(builder.build([105], lps[:1]))["text_offset"] == [2]  # a stream goes on


def test_unknown_fields_are_refused_by_name_and_harmless_ones_ignored():
    for parse in (completion, chat):
        err = invalid(parse, frobnicate=1, bad_words=["x"])
        assert (err.status, err.param, err.code) == (400, "frobnicate", "unsupported_parameter")
        assert "'frobnicate', 'bad_words'" in err.message
        assert parse(user="u-1", metadata={"a": "b"}, store=False, skip_special_tokens=True)
        assert parse(prompt_logprobs=None)  # null: absent
        assert invalid(parse, store=True).param == "store"
        assert invalid(parse, skip_special_tokens=False).param == "skip_special_tokens"
    for name in ("guided_whitespace_pattern", "chat_template_kwargs", "allowed_token_ids"):
        assert invalid(chat, **{name: {"x": 1}}).param == name
    assert chat(echo=False, tool_choice="none", add_generation_prompt=True)
    assert completion(add_special_tokens=True, best_of=1, suffix="")
    assert invalid(chat, stream=True, stream_options={"include_usage": True, "x": 1}).param
    err = invalid(chat, messages=[{"role": "user", "content": "hi", "tool_calls": []}])
    assert err.param.startswith("messages[0]")


def test_a_message_name_reaches_the_template():
    req = chat(messages=[{"role": "user", "content": "hi", "name": "ann"}])
    assert req.messages == ({"role": "user", "content": "hi", "name": "ann"},)


# --- /tokenize and /detokenize -------------------------------------------------------------------


def test_tokenize_text_and_chat_as_vllm_answers(tokenizer):
    from kvmesh.services.router.tokens_api import tokenize_body

    answer = wire(tokenize_body({"prompt": "ab"}, MODEL, tokenizer, 100))
    assert answer == {
        "count": 3,
        "max_model_len": 100,
        "tokens": [tokenizer.bos_token_id, 97, 98],
        "token_strs": None,
    }
    plain = tokenize_body(
        {"model": MODEL, "prompt": "ab", "add_special_tokens": False, "return_token_strs": True},
        MODEL,
        tokenizer,
        100,
    )
    assert (plain.tokens, plain.token_strs) == ([97, 98], ["a", "b"])
    messages = [{"role": "user", "content": "hi"}]
    chat_answer = tokenize_body({"messages": messages}, MODEL, tokenizer, 100)
    assert chat_answer.tokens == tokenizer.encode_chat(messages)
    err = invalid(tokenize_body, {"prompt": "x", "model": "other"}, MODEL, tokenizer, 100)
    assert err.status == 404
    assert invalid(tokenize_body, {"prompt": "x", "foo": 1}, MODEL, tokenizer, 100).param == "foo"
    assert invalid(tokenize_body, {"prompt": 3}, MODEL, tokenizer, 100).param == "prompt"


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(tokenizer):
    from kvmesh.services.router.tokens_api import detokenize_body

    assert wire(detokenize_body({"tokens": [104, 105]}, MODEL, tokenizer)) == {"prompt": "hi"}
    assert invalid(detokenize_body, {"tokens": [10**6]}, MODEL, tokenizer).param == "tokens"
    assert invalid(detokenize_body, {"tokens": [-1]}, MODEL, tokenizer).param == "tokens"


# --- structured outputs --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("parse", [completion, chat])
def test_every_spelling_of_a_structured_output_maps_onto_one_spec(parse):
    from kvmesh.shared.text.structured_output import StructuredOutputs

    schema_text = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    cases = {
        "response_format": (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
            StructuredOutputs(json=schema_text),
        ),
        "guided_json": (SCHEMA, StructuredOutputs(json=schema_text)),
        "guided_regex": ("[0-9]+", StructuredOutputs(regex="[0-9]+")),
        "guided_choice": (["yes", "no"], StructuredOutputs(choice=("yes", "no"))),
        "guided_grammar": ('root ::= "a"', StructuredOutputs(grammar='root ::= "a"')),
        "structured_outputs": ({"json": SCHEMA}, StructuredOutputs(json=schema_text)),
    }
    for name, (value, expected) in cases.items():
        req = parse(**{name: value})
        assert (req.sampling.structured_outputs, req.structured_param) == (expected, name)
    json_object = parse(response_format={"type": "json_object"}).sampling.structured_outputs
    assert json_object == StructuredOutputs(json_object=True)
    assert parse(response_format={"type": "text"}).sampling.structured_outputs is None
    assert parse(guided_decoding_backend="xgrammar", guided_regex="a").sampling.structured_outputs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "strict": False},
                }
            },
            "response_format",
        ),
        ({"guided_json": "not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_malformed_structured_outputs_are_400_naming_the_field(body, param):
    for parse in (completion, chat):
        err = invalid(parse, **body)
        assert (err.status, err.param) == (400, param), err.message


def test_a_spec_that_does_not_build_is_400_saying_why():
    from kvmesh.services.router import structured
    from kvmesh.shared.text.structured_output import StructuredOutputs

    limits = RouterConfig().schema_limits()
    err = invalid(structured.check, StructuredOutputs(regex="[a-"), "guided_regex", limits)
    assert (err.status, err.param) == (400, "guided_regex") and "Unclosed '['" in err.message
    spec = StructuredOutputs(json='{"type": "foo"}')
    err = invalid(structured.check, spec, "response_format", limits)
    assert 'Unsupported type "foo"' in err.message
    structured.check(StructuredOutputs(json='{"type": "object"}'), "response_format", limits)


def test_echo_and_prompt_logprobs_ask_the_mesh_to_score_the_prompt():
    assert completion(echo=True).sampling.prompt_logprobs is None  # text only
    req = completion(echo=True, logprobs=2)
    assert (req.echo, req.sampling.prompt_logprobs, req.returns_prompt_logprobs) == (True, 2, False)
    req = completion(prompt_logprobs=4, echo=True, logprobs=1)
    assert (req.sampling.prompt_logprobs, req.returns_prompt_logprobs) == (4, True)
    assert chat(prompt_logprobs=0).sampling.prompt_logprobs == 0
    assert invalid(completion, prompt_logprobs=1, stream=True).param == "prompt_logprobs"
    assert invalid(chat, echo=True).param == "echo"


def test_too_many_prompt_scores_are_400(tokenizer):
    err = invalid(tokenize, completion(prompt=[1] * 2000, echo=True, logprobs=10), tokenizer, 4096)
    assert err.param == "echo" and "16384" in err.message


def test_an_echoed_choice_leads_with_the_prompt_and_its_logprobs():
    from kvmesh.services.router.choices import Choice

    tok = tiny_tokenizer()
    sampling = SamplingOptions(logprobs=0, prompt_logprobs=0)
    choice = Choice.new(0, tok, (104, 105), sampling, is_chat=False, echo_text="hi")
    choice.prompt_scored = [TokenLogprobs(-1.0, rank=2)]
    text, chunk = choice.add(TokenEvent("r", (33,), logprobs=(TokenLogprobs(-0.5),)))
    assert text == "hi!" and wire(chunk)["tokens"] == ["h", "i", "!"]
    assert wire(chunk)["token_logprobs"] == [None, -1.0, -0.5]
    choice.add(TokenEvent("r", (63,), "length", logprobs=(TokenLogprobs(-0.25),)))
    result = choice.result()
    assert result.text == "hi!?"
    assert wire(result.logprobs)["text_offset"] == [0, 1, 2, 3]


def test_vllm_prompt_logprobs_shape():
    from kvmesh.services.router.logprobs import prompt_logprobs

    lps = LogprobsBuilder(tiny_tokenizer(), is_chat=False)
    shaped = wire(prompt_logprobs(lps, [104, 105], [TokenLogprobs(-1.0, (106,), (-0.5,), 2)]))
    assert shaped == [
        None,
        {
            "106": {"logprob": -0.5, "rank": 1, "decoded_token": "j"},
            "105": {"logprob": -1.0, "rank": 2, "decoded_token": "i"},
        },
    ]


def test_a_one_token_prompt_has_empty_prompt_logprobs_without_a_message():
    from kvmesh.services.router.choices import Choice

    sampling = SamplingOptions(logprobs=0, prompt_logprobs=0)
    choice = Choice.new(0, tiny_tokenizer(), (104,), sampling, is_chat=False, echo_text="h")
    choice.add(TokenEvent("r", (105,), "length", logprobs=(TokenLogprobs(-0.5),)))
    assert choice.prompt_scored == []
    assert wire(choice.result().logprobs)["token_logprobs"] == [None, -0.5]
