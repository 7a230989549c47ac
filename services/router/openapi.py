"""The OpenAPI 3.1 document of the router's routes (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from kvmesh.services.router.api import CHAT_ROLES, MAX_SEED, MAX_STOP_STRINGS

OPENAPI_VERSION = "3.1.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_SAMPLING: dict[str, Any] = {
    "model": {
        "type": "string",
        "minLength": 1,
        "description": "Must be the served model (GET /v1/models).",
    },
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": -1, "default": -1, "description": "-1 or 0: off"},
    "seed": _nullable({"type": "integer", "minimum": -MAX_SEED, "maximum": MAX_SEED}),
    "stop": _nullable(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": MAX_STOP_STRINGS,
                },
            ]
        }
    ),
    "n": {"type": "integer", "enum": [1], "default": 1},
    "stream": {"type": "boolean", "default": False},
    "stream_options": _nullable(
        {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}
    ),
    "ignore_eos": {"type": "boolean", "default": False, "description": "kvmesh extension"},
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}

_FINISH_REASON = {"type": "string", "enum": ["stop", "length"]}


def _response(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _nullable(_ref("Usage")),
        },
    }


_SCHEMAS: dict[str, Any] = {
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_SAMPLING,
            "prompt": {
                "description": "Text or token ids; a list of one of those is accepted, "
                "more than one (a batch) is refused.",
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                ],
            },
            "max_tokens": _nullable({"type": "integer", "minimum": 1, "default": 16}),
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": list(CHAT_ROLES)},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {
                                "type": {"const": "text"},
                                "text": {"type": "string"},
                            },
                        },
                    },
                ]
            },
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            "max_tokens": _nullable({"type": "integer", "minimum": 1, "deprecated": True}),
        },
    },
    "Usage": _USAGE,
    "Completion": _response(
        "text_completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "text": {"type": "string"},
                "logprobs": {"type": "null"},
                "finish_reason": _nullable(_FINISH_REASON),
            },
        },
    ),
    "ChatCompletion": _response(
        "chat.completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "message": {
                    "type": "object",
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": "string"},
                    },
                },
                "logprobs": {"type": "null"},
                "finish_reason": _FINISH_REASON,
            },
        },
    ),
    "ChatCompletionChunk": _response(
        "chat.completion.chunk",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "delta": {
                    "type": "object",
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": "string"},
                    },
                },
                "logprobs": {"type": "null"},
                "finish_reason": _nullable(_FINISH_REASON),
            },
        },
    ),
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Model")},
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _nullable({"type": "string"}),
                    "code": _nullable({"type": "string"}),
                },
            }
        },
    },
}


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
        "components": {"schemas": _SCHEMAS},
    }
