"""OpenAI response bodies and SSE chunks, built as plain dicts (pure, no I/O).

Streams are framed as OpenAI frames them: one ``data: {json}\\n\\n`` event per chunk and a final
``data: [DONE]\\n\\n``. Chat streams open with a chunk carrying the assistant role; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk with empty
``choices`` carries the usage.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson
from kvmesh.services.router.api import GenerateRequest
from kvmesh.services.router.errors import ApiError

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def new_request_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class ResponseBuilder:
    """Builds every body of one request's response; ``kind`` picks completion or chat shapes."""

    kind: str
    response_id: str
    model: str
    created: int
    include_usage: bool = False

    @classmethod
    def for_request(cls, request: GenerateRequest, response_id: str) -> ResponseBuilder:
        return cls(
            kind=request.kind,
            response_id=response_id,
            model=request.model,
            created=int(time.time()),
            include_usage=request.include_usage,
        )

    @property
    def _is_chat(self) -> bool:
        return self.kind == "chat"

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The non-streamed response."""
        if self._is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {
            **self._head("chat.completion" if self._is_chat else "text_completion"),
            "choices": [choice],
            "usage": usage.to_dict(),
        }

    def role_chunk(self) -> dict[str, Any] | None:
        """The chunk that opens a chat stream (None for completions)."""
        if not self._is_chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text} if self._is_chat else text, None)

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({} if self._is_chat else "", finish_reason)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(self._chunk_object), "choices": [], "usage": usage.to_dict()}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self._is_chat else "text_completion"

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        if self._is_chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}


def error_event(error: ApiError) -> bytes:
    """An error after the stream has started (the status line is already sent)."""
    return sse_event(error.body())
