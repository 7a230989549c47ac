"""OpenAI response bodies and SSE chunks, built as the Structs of ``response_bodies.py`` (pure,
no I/O).

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

import msgspec
from kvmesh.services.router.api import GenerateRequest
from kvmesh.services.router.errors import ApiError
from kvmesh.services.router.request_bodies import FunctionCall, ToolCall
from kvmesh.services.router.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallDelta,
    PromptLogprobs,
    TextCompletion,
    ToolCallDelta,
    Usage,
)
from kvmesh.shared.text.tool_calls import CallDelta, ParsedCall, new_call_id

SSE_DONE = b"data: [DONE]\n\n"

Body = TextCompletion | ChatCompletion | ChatCompletionChunk
Logprobs = ChatLogprobs | CompletionLogprobs


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One finished choice of a non-streamed answer."""

    index: int
    text: str | None  # None: a chat answer of tool calls only
    finish_reason: str
    logprobs: Logprobs | None = None
    tool_calls: tuple[ParsedCall, ...] = ()


def sse_event(payload: Body | dict[str, Any], event_id: str | None = None) -> bytes:
    """One SSE event; ``event_id``: its ``id:`` line (a resumable stream's: stream_ids.py)."""
    data = b"data: " + msgspec.json.encode(payload) + b"\n\n"
    return data if event_id is None else b"id: " + event_id.encode() + b"\n" + data


def sse_done(event_id: str | None = None) -> bytes:
    """``data: [DONE]``, with its ``id:`` line in a resumable stream."""
    return SSE_DONE if event_id is None else b"id: " + event_id.encode() + b"\n" + SSE_DONE


def new_request_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


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

    def full(
        self,
        choices: list[ChoiceResult],
        usage: Usage,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> TextCompletion | ChatCompletion:
        """The non-streamed response; ``prompt_logprobs``: vLLM's, when asked for (chat: of
        the answer; completions: of each choice)."""
        head = self._head()
        scored: dict[str, Any] = (
            {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
        )
        if self._is_chat:
            chat = [
                ChatChoice(
                    index=c.index,
                    message=_message(c),
                    logprobs=c.logprobs,  # type: ignore[arg-type]
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ]
            return ChatCompletion(
                object="chat.completion", choices=chat, usage=usage, **head, **scored
            )
        plain = [
            CompletionChoice(
                index=c.index,
                text=c.text or "",
                logprobs=c.logprobs,  # type: ignore[arg-type]
                finish_reason=c.finish_reason,
                **scored,
            )
            for c in choices
        ]
        return TextCompletion(object="text_completion", choices=plain, usage=usage, **head)

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk | None:
        """The chunk that opens a chat choice's stream (None for completions)."""
        if not self._is_chat:
            return None
        return self._chat_chunk(index, ChatDelta(role="assistant", content=""), None)

    def text_chunk(
        self, text: str, index: int = 0, logprobs: Logprobs | None = None
    ) -> TextCompletion | ChatCompletionChunk:
        if self._is_chat:
            return self._chat_chunk(index, ChatDelta(content=text), None, logprobs)
        return self._completion_chunk(index, text, None, logprobs)

    def tool_chunk(self, delta: CallDelta, index: int = 0) -> ChatCompletionChunk:
        """A streamed tool call's first delta (id, type, name) or a fragment of its arguments."""
        function = FunctionCallDelta(arguments=delta.arguments)
        call = ToolCallDelta(index=delta.index, function=function)
        if delta.id is not None:
            assert delta.name is not None
            function.name, call.id, call.type = delta.name, delta.id, "function"
        return self._chat_chunk(index, ChatDelta(tool_calls=[call]), None)

    def finish_chunk(
        self, finish_reason: str, index: int = 0
    ) -> TextCompletion | ChatCompletionChunk:
        if self._is_chat:
            return self._chat_chunk(index, ChatDelta(), finish_reason)
        return self._completion_chunk(index, "", finish_reason)

    def usage_chunk(self, usage: Usage) -> TextCompletion | ChatCompletionChunk:
        if self._is_chat:
            return ChatCompletionChunk(
                object="chat.completion.chunk", choices=[], usage=usage, **self._head()
            )
        return TextCompletion(object="text_completion", choices=[], usage=usage, **self._head())

    def _chat_chunk(
        self,
        index: int,
        delta: ChatDelta,
        finish_reason: str | None,
        logprobs: Logprobs | None = None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,  # type: ignore[arg-type]
            finish_reason=finish_reason,
        )
        return ChatCompletionChunk(
            object="chat.completion.chunk", choices=[choice], **self._head(), **self._no_usage()
        )

    def _completion_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Logprobs | None = None,
    ) -> TextCompletion:
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,  # type: ignore[arg-type]
            finish_reason=finish_reason,
        )
        return TextCompletion(
            object="text_completion", choices=[choice], **self._head(), **self._no_usage()
        )

    def _no_usage(self) -> dict[str, None]:
        # with include_usage, every chunk but the last says "usage": null; otherwise no key
        return {"usage": None} if self.include_usage else {}

    def _head(self) -> dict[str, Any]:
        return {"id": self.response_id, "created": self.created, "model": self.model}


def _message(choice: ChoiceResult) -> AssistantMessage:
    if not choice.tool_calls:
        return AssistantMessage(role="assistant", content=choice.text)
    calls = [
        ToolCall(new_call_id(), "function", FunctionCall(c.name, c.arguments))
        for c in choice.tool_calls
    ]
    return AssistantMessage(role="assistant", content=choice.text, tool_calls=calls)


def error_event(error: ApiError, event_id: str | None = None) -> bytes:
    """An error after the stream has started (the status line is already sent)."""
    return sse_event(error.body(), event_id)
