"""The router's routes (``ROUTES``) and their OpenAPI 3.1 document (served at ``/openapi.json``).

One list makes both: ``app.py`` builds aiohttp's router from ``ROUTES`` and ``openapi_document``
the paths. Every body's schema is generated from its Struct in ``request_bodies.py`` or
``response_bodies.py`` (the same Structs that validate requests and encode answers); only the
routes are written here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from kvmesh.services.router.request_bodies import REQUESTS
from kvmesh.services.router.response_bodies import RESPONSES
from kvmesh.services.router.timings import STAGES

OPENAPI_VERSION = "3.1.0"
_REF_TEMPLATE = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF_TEMPLATE.format(name=name)}


def schemas() -> dict[str, Any]:
    """``components.schemas``: the JSON Schema of every request and response body."""
    _, components = msgspec.json.schema_components(REQUESTS + RESPONSES, ref_template=_REF_TEMPLATE)
    return components


def _errors(*statuses: int) -> dict[str, Any]:
    described = {
        400: "Invalid JSON or parameter (`param` names it); prompt longer than the context",
        404: "Unknown model",
        429: "The mesh is at capacity; see Retry-After",
        502: "A mesh peer failed the request",
        503: "A part of the mesh is missing, or the router is at its request limit",
        504: "A mesh peer did not answer in time",
    }
    return {
        str(s): {
            "description": described[s],
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        for s in statuses
    }


def _generate_operation(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": "The completion; with stream=true, server-sent events "
                "`data: {chunk}` ending with `data: [DONE]`",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _ref(chunk)},
                },
            },
            **_errors(400, 404, 429, 502, 503, 504),
        },
    }


def _post_operation(summary: str, request: dict[str, Any], response: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {
                "description": "The answer",
                "content": {"application/json": {"schema": _ref(response)}},
            },
            **_errors(400, 404),
        },
    }


def _get_operation(summary: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"summary": summary, **more, "responses": responses}


def _json_answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


@dataclass(frozen=True, slots=True)
class Route:
    """One route the router serves; ``operation`` is its OpenAPI operation (None: the route is
    left out of the document)."""

    method: Literal["GET", "POST"]
    path: str
    handler: str  # the name of the ``app.Router`` method that answers it
    operation: dict[str, Any] | None


def _timings_schema() -> dict[str, Any]:
    """``GET /v1/kvmesh/timings``: services/router/timings.py's TimingLog.to_json."""
    number = {"type": "number"}
    row = {
        "type": "object",
        "properties": {
            "request_id": {"type": "string"},
            "local_prefill": {"type": "boolean"},
            "num_prompt_tokens": {"type": "integer"},
            "ttft_s": number,
            **dict.fromkeys(STAGES, number),
        },
    }
    return {
        "type": "object",
        "properties": {
            "stages": {"type": "array", "items": {"type": "string", "enum": list(STAGES)}},
            "requests": {"type": "array", "items": row},
        },
    }


_TIMINGS_SCHEMA = _timings_schema()

_HEALTH_SCHEMA = {  # GET /health's body (app.py Router.health), either status
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"type": "string", "enum": ["ok", "unavailable"]},
        "reason": {"type": "string"},
        "model": {"type": "string"},
        "decode_workers": {"type": "integer"},
        "prefill_workers": {"type": "integer"},
    },
}

ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/completions",
        "completions",
        _generate_operation(
            "Complete a prompt", "CompletionRequest", "TextCompletion", "TextCompletion"
        ),
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        "chat_completions",
        _generate_operation(
            "Answer a chat", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
        ),
    ),
    Route(
        "GET",
        "/v1/models",
        "models",
        _get_operation("The served model", {"200": _json_answer("Model list", _ref("ModelList"))}),
    ),
    Route(
        "GET",
        "/v1/models/{model}",
        "model_detail",
        _get_operation(
            "One model",
            {"200": _json_answer("The model", _ref("Model")), **_errors(404)},
            parameters=[
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
        ),
    ),
    Route(
        "POST",
        "/tokenize",
        "tokenize",
        _post_operation(
            "Token ids of a prompt, or of chat messages through the chat template (vLLM's)",
            {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
            "TokenizeResponse",
        ),
    ),
    Route(
        "POST",
        "/detokenize",
        "detokenize",
        _post_operation(
            "Text of token ids (vLLM's)", _ref("DetokenizeRequest"), "DetokenizeResponse"
        ),
    ),
    Route(
        "GET",
        "/health",
        "health",
        _get_operation(
            "Readiness: NATS connected and at least one decode (or colocated) worker ready",
            {
                "200": {
                    "description": "Serving: the model and the ready decode and prefill workers",
                    "content": {"application/json": {"schema": _HEALTH_SCHEMA}},
                },
                "503": {
                    "description": (
                        "Not serving, ``reason`` says why: the router is shutting down, not "
                        "connected to NATS, or no decode worker ready (none heard yet, or all "
                        "draining; with Retry-After)"
                    ),
                    "content": {"application/json": {"schema": _HEALTH_SCHEMA}},
                },
            },
        ),
    ),
    Route(
        "GET",
        "/metrics",
        "metrics_text",
        _get_operation(
            "Prometheus metrics",
            {
                "200": {
                    "description": "Text exposition format 0.0.4",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        ),
    ),
    Route(
        "GET",
        "/openapi.json",
        "openapi",
        _get_operation("This document", {"200": {"description": "OpenAPI 3.1 document"}}),
    ),
    Route(
        "GET",
        "/v1/kvmesh/timings",
        "request_timings",
        _get_operation(
            "The latest finished requests' time to first token by stage (seconds)",
            {
                "200": {
                    "description": "The stages in order, and one row per request",
                    "content": {"application/json": {"schema": _TIMINGS_SCHEMA}},
                }
            },
        ),
    ),
)


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI document of the routes the router serves (``ROUTES``)."""
    paths: dict[str, Any] = {}
    for route in ROUTES:
        if route.operation is not None:  # a copy: each document is the caller's to change
            operation = copy.deepcopy(route.operation)
            paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvmesh router",
            "version": "0.1.0",
            "description": f"OpenAI-compatible API of kvmesh, serving {model_name!r}.",
        },
        "paths": paths,
        "components": {"schemas": schemas()},
    }
