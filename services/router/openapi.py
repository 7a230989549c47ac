"""The OpenAPI 3.1 document of the router's routes (served at ``/openapi.json``).

Every body's schema is generated from its Struct in ``schema.py`` (the same Structs that validate
requests and encode answers); only the routes are written here.
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvmesh.services.router.schema import REQUESTS, RESPONSES

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
        "post": {
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
    }


def _post_operation(summary: str, request: dict[str, Any], response: str) -> dict[str, Any]:
    return {
        "post": {
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
    }


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI document of every route the router serves."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvmesh router",
            "version": "0.1.0",
            "description": f"OpenAI-compatible API of kvmesh, serving {model_name!r}.",
        },
        "paths": {
            "/v1/completions": _generate_operation(
                "Complete a prompt", "CompletionRequest", "Completion", "Completion"
            ),
            "/v1/chat/completions": _generate_operation(
                "Answer a chat", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            ),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "responses": {
                        "200": {
                            "description": "Model list",
                            "content": {"application/json": {"schema": _ref("ModelList")}},
                        }
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "The model",
                            "content": {"application/json": {"schema": _ref("Model")}},
                        },
                        **_errors(404),
                    },
                }
            },
            "/tokenize": _post_operation(
                "Token ids of a prompt, or of chat messages through the chat template (vLLM's)",
                {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
                "TokenizeResponse",
            ),
            "/detokenize": _post_operation(
                "Text of token ids (vLLM's)", _ref("DetokenizeRequest"), "DetokenizeResponse"
            ),
            "/health": {
                "get": {
                    "summary": "Liveness and NATS connectivity",
                    "responses": {
                        "200": {"description": "Serving"},
                        "503": {"description": "Not connected to NATS"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "Text exposition format 0.0.4",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1 document"}},
                }
            },
        },
        "components": {"schemas": schemas()},
    }
