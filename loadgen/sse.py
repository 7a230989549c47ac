"""Server-sent events of an OpenAI-style stream -> typed chunks (pure, no I/O).

``SseDecoder`` cuts a byte stream into events (``data:`` lines up to a blank line, any split of
the bytes, LF or CRLF); ``read_chunk`` says what one event's data carries: output text
(``choices[0].text`` for completions, ``choices[0].delta.content`` for chat), usage, the end
(``[DONE]``) or an error (an ``{"error": ...}`` event, or data that is not JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DONE = "[DONE]"


class SseDecoder:
    """Feed raw bytes; get back the data of every event they complete."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, raw: bytes) -> list[str]:
        self._buffer += raw
        events = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            text = line.rstrip(b"\r").decode("utf-8", errors="replace")
            if not text:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif text.startswith("data:"):
                value = text[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # comments (":...") and other fields (event:, id:, retry:) carry no data
        return events


@dataclass(frozen=True, slots=True)
class StreamUsage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One event: ``content`` is the output text it adds ("" for role, finish and usage chunks);
    ``is_token``: it carries output, if only a token that completes no character yet (servers
    such as vLLM and kvmesh stream one chunk per token, with "" while a multi-byte character or
    a possible stop string is incomplete), so token gaps are measured per token."""

    content: str = ""
    is_token: bool = False
    usage: StreamUsage | None = None
    is_done: bool = False
    error: str | None = None
    response_id: str = ""  # the chunk's ``id`` (the server's id of the request), when it has one


def read_chunk(data: str, is_chat: bool) -> Chunk:
    if data.strip() == DONE:
        return Chunk(is_done=True)
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Chunk(error=f"an event is not JSON: {data[:120]!r}")
    if not isinstance(payload, dict):
        return Chunk(error=f"an event is not a JSON object: {data[:120]!r}")
    if payload.get("error") is not None:
        return Chunk(error=_error_message(payload["error"]))
    content = _content(payload, is_chat)
    return Chunk(
        content=content,
        is_token=bool(content) or _is_empty_token(payload, is_chat),
        usage=_usage(payload.get("usage")),
        response_id=payload["id"] if isinstance(payload.get("id"), str) else "",
    )


def _first_choice(payload: dict[str, Any]) -> dict[str, Any] | None:
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _is_empty_token(payload: dict[str, Any], is_chat: bool) -> bool:
    """A choice with an empty text that is neither the role chunk nor the finish chunk."""
    choice = _first_choice(payload)
    if choice is None or choice.get("finish_reason") is not None:
        return False
    if is_chat:
        delta = choice.get("delta")
        return isinstance(delta, dict) and "role" not in delta and delta.get("content") == ""
    return choice.get("text") == ""


def _content(payload: dict[str, Any], is_chat: bool) -> str:
    choice = _first_choice(payload)
    if choice is None:
        return ""
    if is_chat:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def _usage(usage: Any) -> StreamUsage | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (isinstance(prompt, int) and isinstance(completion, int)):
        return None
    return StreamUsage(prompt, completion)


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
