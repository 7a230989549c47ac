"""The router's HTTP answers, stream chunks and errors, each defined once as a msgspec Struct.

``responses.py`` builds them and the router encodes them; ``openapi.py`` publishes their JSON
Schema, so the document at ``/openapi.json`` cannot drift from the code. The request bodies are
request_bodies.py's.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from kvmesh.services.router.request_bodies import ToolCall
from msgspec import UNSET, UnsetType

FinishReason = Literal["stop", "length", "tool_calls"]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int  # the context a request can use (as /v1/models reports it)
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    """OpenAI's breakdown of the completion tokens; kvmesh fills in the accepted predictions."""

    accepted_prediction_tokens: int = 0


class Usage(msgspec.Struct):
    """Token counts of one request; ``total_tokens`` is their sum. With speculative decoding,
    ``completion_tokens_details.accepted_prediction_tokens`` counts the completion tokens that
    were draft tokens the target model verified and accepted (absent when none were)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET

    def __post_init__(self) -> None:
        self.total_tokens = self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, accepted_drafts: int = 0) -> Usage:
        if not accepted_drafts:
            return cls(prompt_tokens, completion_tokens)
        details = CompletionTokensDetails(accepted_prediction_tokens=accepted_drafts)
        return cls(prompt_tokens, completion_tokens, completion_tokens_details=details)


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of the likeliest tokens at a position (chat ``logprobs``)."""

    token: str
    logprob: float
    bytes: list[int] | None  # the token's text as UTF-8


class TokenLogprob(msgspec.Struct, kw_only=True):
    """An output token's log-probability and its position's likeliest tokens (chat)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """A chat choice's (or chunk's) ``logprobs``: one entry per token of its content."""

    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """A completion choice's (or chunk's) ``logprobs``, the legacy shape: per token its text,
    log-probability, the likeliest tokens (and the chosen one) by text, and where its text
    starts in the choice's text (of the whole choice, across a stream's chunks)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``prompt_logprobs`` entry of one token (keyed by its id, as a string)."""

    logprob: float
    rank: int | None  # 1: the likeliest
    decoded_token: str


# per prompt token, the first one null: {token id: entry} of the token and the likeliest
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # null in every stream chunk but the last
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked for


class TextCompletion(msgspec.Struct, kw_only=True):
    """The answer of ``/v1/completions``, and each event of its stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    # streams: absent, or null in every chunk but the last with stream_options.include_usage
    usage: Usage | UnsetType | None = UNSET


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # with tools: the calls the model made


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    """The answer of ``/v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked for


class FunctionCallDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # in a call's first delta
    arguments: str = ""  # a fragment of the arguments' JSON text


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A streamed call: its id, type and name in its first delta, its arguments in pieces."""

    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET


class ChatDelta(msgspec.Struct, kw_only=True):
    """What a chunk adds: the role (first chunk), text, tool calls, or nothing (the finishing
    chunk)."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a ``/v1/chat/completions`` stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the usage chunk
    usage: Usage | UnsetType | None = UNSET


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | UnsetType = UNSET


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(msgspec.Struct):
    """Every 4xx and 5xx answer (``errors.ApiError.body()``), and an error event in a stream."""

    error: ErrorDetail


RESPONSES = (
    TextCompletion,
    ChatCompletion,
    ChatCompletionChunk,
    ModelList,
    Model,
    Error,
    TokenizeResponse,
    DetokenizeResponse,
)
