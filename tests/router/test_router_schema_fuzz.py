"""Schema fuzzing of the router's HTTP API, driven by the router's own ``/openapi.json``.

Request bodies are drawn (hypothesis, ``json_schema_strategies``) from the request schemas the live
router serves, then sent as they are or broken: a required field dropped, a field of the wrong
type, huge numbers, extra and unsupported fields, deep nesting, unicode that is not UTF-8,
garbage and non-JSON bodies. GET routes get random path parameters and query strings, and every
documented path random methods. Every answer must be below 500; a 4xx must be the OpenAI error
object of the document's ``Error`` schema; a 200 must match the document's response schema, and a
stream that starts 200 must end with ``data: [DONE]`` and carry no error event. After each run a
plain completion must still be served.

The router runs as its own process (``kvmesh serve router``) on a real nats-server, served by the
fake mesh peer of ``router_fake_mesh``; hypothesis drives it from plain synchronous tests. Example
counts are bounded and the seed is fixed (``derandomize``): the file takes well under a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from kvmesh.shared.config.ports import free_port
from support.json_schema_strategies import from_schema, inline_refs
from support.router_fake_mesh import FakeMesh
from yarl import URL

MODEL = "kvmesh-tiny"
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
REQUEST_TIMEOUT_S = 20.0
STARTUP_TIMEOUT_S = 60.0
REPLY = "Fuzzed."  # the fake mesh's every reply: short, so that generation stays quick
REPO = Path(__file__).resolve().parents[2]

FUZZ = settings(
    derandomize=True,  # the same examples on every run
    database=None,  # nothing written next to the tests
    deadline=None,  # requests go over HTTP and NATS; time is not the property under test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes


class LiveRouter:
    """The router as a ``kvmesh serve router`` process, and on an event loop in a background
    thread of this process the fake mesh peer it serves from and the HTTP client that fuzzes it.

    A process of its own, not a task in this one: hypothesis raises this interpreter's recursion
    limit while it runs examples, which would hide a stack overflow in the router."""

    def __init__(self, nats_url: str) -> None:
        self._nats_url = nats_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stack = contextlib.AsyncExitStack()
        self._process: subprocess.Popen | None = None
        self.url = ""

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> LiveRouter:
        self._thread.start()
        try:
            self.run(self._start(), timeout_s=STARTUP_TIMEOUT_S + 5)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self.run(self._stack.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        await self._stack.enter_async_context(FakeMesh(self._nats_url, reply_text=REPLY).running())
        self._http = await self._stack.enter_async_context(aiohttp.ClientSession())
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        # its log goes to this test's captured output: a 500's traceback shows with the failure
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "router", "--nats-url", self._nats_url,
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:  # until it serves and has heard the fake decode worker
            assert self._process.poll() is None, "the router process exited on start"
            with contextlib.suppress(aiohttp.ClientConnectionError):
                if (await self._send("GET", "/health", None, {})).status == 200:
                    return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the router did not report ready within {STARTUP_TIMEOUT_S} s")

    def request(
        self, method: str, target: str, body: bytes | None = None, headers: dict | None = None
    ) -> Reply:
        """``target`` is sent as it is: an already percent-encoded path and query."""
        return self.run(self._send(method, target, body, headers or {}))

    async def _send(self, method: str, target: str, body: bytes | None, headers: dict) -> Reply:
        url = URL(self.url + target, encoded=True)
        async with self._http.request(method, url, data=body, headers=headers) as resp:
            return Reply(resp.status, resp.headers.get("Content-Type", ""), await resp.read())


@pytest.fixture(scope="module")
def live_router(nats_server_module: str) -> Iterator[LiveRouter]:
    """One router process for the module's tests; each ends by checking it still serves."""
    with LiveRouter(nats_server_module) as router:
        yield router


# --- the document ------------------------------------------------------------------------------


class Api:
    """What the tests need from the served OpenAPI document: request schemas, and validators of
    error bodies and of each route's 200 answers."""

    def __init__(self, document: dict) -> None:
        self.document = document
        self.error = Draft202012Validator(self._schema({"$ref": "#/components/schemas/Error"}))
        self.answers: dict[tuple[str, str, str], Draft202012Validator] = {}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                for content_type, media in operation["responses"]["200"].get("content", {}).items():
                    key = (path, method.upper(), content_type)
                    self.answers[key] = Draft202012Validator(self._schema(media["schema"]))

    def _schema(self, node: dict) -> dict:
        return inline_refs(node, self.document)

    def request_schema(self, path: str) -> dict:
        body = self.document["paths"][path]["post"]["requestBody"]
        return self._schema(body["content"]["application/json"]["schema"])


def served_api(router: LiveRouter) -> Api:
    reply = router.request("GET", "/openapi.json")
    assert reply.status == 200 and reply.content_type.startswith("application/json")
    document = orjson.loads(reply.body)
    assert set(POST_PATHS) <= set(document["paths"])
    return Api(document)


# --- checking an answer ------------------------------------------------------------------------


def sse_payloads(raw: bytes) -> list[bytes]:
    """The payloads of an SSE body, checking OpenAI's framing."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    # a resumable stream's events carry an id line first (docs/faults.md)
    events = [re.sub(rb"^id: [^\n]+\n", b"", e) for e in raw[:-2].split(b"\n\n")]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw[:400]
    return [e[len(b"data: ") :] for e in events]


def check_reply(api: Api, method: str, route: str, sent: bytes | None, reply: Reply) -> str:
    """Assert the answer is well formed for what was sent to ``route`` (a path of the document,
    or any other path); returns its kind for the tally."""
    what = f"{method} {route} with {sent[:300]!r}" if sent is not None else f"{method} {route}"
    assert reply.status < 500, f"{what} -> {reply.status}: {reply.body[:500]!r}"
    if reply.status >= 400:
        if method == "HEAD":  # no body to check
            return "4xx"
        assert reply.content_type.startswith("application/json"), (what, reply)
        error = orjson.loads(reply.body)
        api.error.validate(error)
        assert error["error"]["message"], (what, error)
        return "4xx"
    if reply.status != 200 or method == "HEAD":
        return str(reply.status)
    content_type = reply.content_type.split(";")[0]
    if content_type == "text/event-stream":
        payloads = sse_payloads(reply.body)
        assert payloads[-1] == b"[DONE]", (what, reply.body[-300:])
        for payload in payloads[:-1]:
            chunk = orjson.loads(payload)
            assert "error" not in chunk, (what, chunk)
            api.answers[(route, method, content_type)].validate(chunk)
        return "stream"
    if method == "POST":
        assert content_type == "application/json", (what, reply)
    answer = api.answers.get((route, method, content_type))
    if content_type == "application/json" and answer is not None:
        answer.validate(orjson.loads(reply.body))
    return "200"


def check_still_serving(router: LiveRouter) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 16})
    reply = router.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert reply.status == 200, reply
    assert orjson.loads(reply.body)["choices"][0]["text"] == REPLY


# --- strategies --------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
huge_numbers = st.sampled_from(
    [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 10**30, 1e308, -1e308, 5e-324, -0.0]
)
# parameters of one route sent to another, those refused unless neutral, those ignored
# when harmless (services/router/api.py), and some of vLLM's that kvmesh refuses
other_fields = st.sampled_from(
    [
        "n", "best_of", "echo", "logprobs", "top_logprobs", "suffix", "presence_penalty",
        "frequency_penalty", "logit_bias", "min_tokens", "repetition_penalty", "min_p",
        "stop_token_ids", "include_stop_str_in_output", "tools", "functions", "response_format",
        "user", "tool_choice", "parallel_tool_calls", "metadata", "store", "service_tier",
        "skip_special_tokens", "add_special_tokens", "add_generation_prompt", "guided_json",
        "guided_regex", "guided_choice", "prompt_logprobs", "bad_words", "allowed_token_ids",
        "chat_template_kwargs", "messages", "prompt", "tokens", "return_token_strs",
    ]
)  # fmt: skip


MUTATIONS = (
    "drop", "retype", "huge", "extra", "unsupported", "nest", "surrogate", "big", "top", "bytes",
    "cut",
)  # fmt: skip
surrogates = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=2)
NEST = "<nested value>"  # stands in for a value nested too deep for json.dumps to write


def encode(value: Any, ensure_ascii: bool) -> bytes:
    # surrogatepass: a lone surrogate in a drawn string becomes bytes that are not UTF-8
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def valid_bodies(schema: dict) -> st.SearchStrategy[dict]:
    """Bodies of ``schema``; most name the served model (the schema cannot say which) and half
    stream."""

    can_stream = "stream" in schema.get("properties", {})

    def adjust(body: dict, served: bool, stream: bool) -> dict:
        return {
            **body,
            **({"model": MODEL} if served else {}),
            **({"stream": True} if stream and can_stream else {}),
        }

    # Bodies with every optional field drawn are mostly refused for what they combine (a grammar
    # and a regex, prompt_logprobs in a stream...); half carry only the required fields, so that
    # generation and streaming are reached too.
    props = schema.get("properties", {})
    lean = {**schema, "properties": {k: v for k, v in props.items() if k in schema["required"]}}
    drawn = from_schema(lean) | from_schema(schema) if "required" in schema else from_schema(schema)
    return st.builds(adjust, drawn, st.sampled_from([True, True, True, False]), st.booleans())


@st.composite
def broken_bodies(draw: st.DrawFn, schema: dict, valid: st.SearchStrategy[dict]) -> bytes:
    """A request body that breaks ``schema``: mutated, garbage, or not JSON at all."""
    kind = draw(st.sampled_from(MUTATIONS))
    if kind == "top":
        return encode(draw(json_values), draw(st.booleans()))
    if kind == "bytes":
        return draw(st.binary(max_size=64) | st.sampled_from([b"", b"null", b"{", b"{}}", b"\xff"]))
    body = dict(draw(valid))
    if "anyOf" in schema:  # /tokenize: mutate as the option that fits the body
        options = [o for o in schema["anyOf"] if set(o["required"]) <= set(body)]
        schema = options[-1] if options else schema["anyOf"][0]
    fields = sorted(schema["properties"])
    if kind == "drop":
        body.pop(draw(st.sampled_from(schema["required"])), None)
    elif kind == "retype":
        body[draw(st.sampled_from(fields))] = draw(json_values)
    elif kind == "huge":
        body[draw(st.sampled_from(fields))] = draw(
            huge_numbers | st.lists(huge_numbers, max_size=3)
        )
    elif kind == "extra":
        body.update(draw(st.dictionaries(st.text(max_size=12), json_values, max_size=3)))
    elif kind == "unsupported":
        body[draw(other_fields)] = draw(json_values)
    elif kind == "nest":  # a value inside many lists, up to past the JSON parser's depth limit
        depth = draw(st.sampled_from([2, 1000]) | st.integers(900, 1100))  # orjson stops at 1024
        field = draw(st.sampled_from(fields))
        inner = encode(body.get(field, 1), ensure_ascii=True)
        body[field] = NEST
        return encode(body, True).replace(encode(NEST, True), b"[" * depth + inner + b"]" * depth)
    elif kind == "surrogate":  # a lone surrogate: escaped (not JSON) or raw (not UTF-8)
        body[draw(st.sampled_from(fields))] = draw(st.text(max_size=4)) + draw(surrogates)
    elif kind == "big":  # over the router's inline limit: parsed in a worker thread
        body["user"] = "u" * 70_000
    raw = encode(body, draw(st.booleans()))
    if kind == "cut":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw


content_types = st.sampled_from(
    [{"Content-Type": "application/json"}, {"Content-Type": "text/plain"}, {}]
)
path_text = st.text(max_size=24).map(lambda s: quote(s.encode("utf-8", "surrogatepass"), safe=""))
query_strings = st.one_of(
    st.just(""),
    st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3).map(
        lambda q: "?" + urlencode(q, encoding="utf-8", errors="surrogatepass")
    ),
    st.binary(max_size=24).map(lambda b: "?" + quote(b, safe="=&")),
)


# --- the tests ---------------------------------------------------------------------------------


def fuzz_post(live_router: LiveRouter, broken: bool, max_examples: int) -> Counter:
    """Send bodies drawn from each POST route's request schema (or broken ones) to the router."""
    api = served_api(live_router)
    bodies = {}
    for path in POST_PATHS:
        schema = api.request_schema(path)
        valid = valid_bodies(schema)
        bodies[path] = (
            broken_bodies(schema, valid) if broken else valid.map(lambda b: encode(b, False))
        )
    tally: Counter = Counter()

    @settings(FUZZ, max_examples=max_examples)
    @given(path=st.sampled_from(POST_PATHS), data=st.data(), headers=content_types)
    def one_request(path: str, data: st.DataObject, headers: dict) -> None:
        sent = data.draw(bodies[path], label="body")
        reply = live_router.request("POST", path, sent, headers)
        tally[check_reply(api, "POST", path, sent, reply)] += 1

    one_request()
    return tally


def test_schema_valid_bodies_get_no_5xx_and_well_formed_answers(live_router):
    tally = fuzz_post(live_router, broken=False, max_examples=400)
    # the fuzzer reached generation, streamed and not, and the refusals
    assert tally["200"] >= 5 and tally["stream"] >= 5 and tally["4xx"] >= 5, tally
    check_still_serving(live_router)


def test_broken_bodies_get_4xx_errors_in_openai_shape(live_router):
    tally = fuzz_post(live_router, broken=True, max_examples=200)
    assert tally["4xx"] >= 100, tally
    check_still_serving(live_router)


def test_every_path_with_random_params_queries_and_methods_gets_no_5xx(live_router):
    api = served_api(live_router)
    tally: Counter = Counter()

    @settings(FUZZ, max_examples=120)
    @given(
        template=st.sampled_from(sorted(api.document["paths"])),
        param=path_text,
        query=query_strings,
        method=st.sampled_from(METHODS) | st.just("GET"),
    )
    def one_request(template: str, param: str, query: str, method: str) -> None:
        path = template.replace("{model}", param if param else MODEL)
        reply = live_router.request(method, path + query)
        tally[check_reply(api, method, template, None, reply)] += 1

    one_request()

    @settings(FUZZ, max_examples=60)
    @given(tail=path_text, method=st.sampled_from(METHODS))
    def unknown_route(tail: str, method: str) -> None:
        reply = live_router.request(method, "/v1/" + tail)
        tally[check_reply(api, method, "/v1/" + tail, None, reply)] += 1

    unknown_route()
    assert tally["200"] >= 10 and tally["4xx"] >= 10, tally
    check_still_serving(live_router)
