"""A validated request made concrete: prompt token ids and wire sampling options (pure).

``tokenize`` applies the chat template or encodes the prompt, and checks the prompt and
``max_tokens`` against the model context so the mesh never sees a request it cannot hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from kvmesh.services.router.api import GenerateRequest
from kvmesh.services.router.errors import InvalidRequestError
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.tokenizer import Tokenizer, TokenizerError
from kvmesh.shared.text.tool_prompt import ToolUse, chat_inputs

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# prompt logprobs travel in one message (PrefillDone, TokenEvent): tokens x (1 + alternatives)
MAX_PROMPT_SCORES = 16_384


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request made concrete: the token ids to prefill and how to sample after them."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions


def tokenize(
    request: GenerateRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    kv_pool_tokens: int | None = None,
    tool_parser: str = "hermes",
) -> Prompt:
    """Prompt ids and sampling options for ``request``; refuses prompts the context cannot hold:
    the model's ``max_model_len``, or ``kv_pool_tokens`` (the largest decode worker's KV pool)
    when that is smaller. ``tool_parser`` is the format a template without tools is told to
    write calls in."""
    if request.messages is not None:
        ids = tuple(encode_chat(tokenizer, request.messages, request.tools, tool_parser))
        param = "messages"
    elif request.prompt_ids is not None:
        ids = request.prompt_ids
        bad = next((i for i in ids if i >= tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary (size {tokenizer.vocab_size})",
                param="prompt",
            )
        param = "prompt"
    else:
        assert request.prompt_text is not None
        ids = tuple(tokenizer.encode(request.prompt_text))
        param = "prompt"
    if not ids:
        raise InvalidRequestError("the prompt is empty; send at least one token", param=param)
    context = f"the model's context is {max_model_len} tokens"
    fix = ""
    if kv_pool_tokens is not None and kv_pool_tokens < max_model_len:
        max_model_len = kv_pool_tokens
        context = f"the largest decode worker's KV pool holds {kv_pool_tokens} tokens"
        fix = (
            ", or give the decode workers more KV memory (--num-blocks or --kv-cache-bytes, "
            "KVMESH_NUM_BLOCKS / KVMESH_KV_CACHE_BYTES)"
        )
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt is {len(ids)} tokens but {context} (prompt plus output); shorten the "
            f"prompt{fix}",
            param=param,
            code="context_length_exceeded",
        )
    room = max_model_len - len(ids)
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if request.kind == "completion" else room
        max_tokens = min(max_tokens, room)
    elif max_tokens > room:
        name = "max_tokens" if request.kind == "completion" else "max_completion_tokens"
        raise InvalidRequestError(
            f"the prompt is {len(ids)} tokens and {name} is {max_tokens}, more than fits: "
            f"{context}; set {name} to at most {room}{fix}",
            param=name,
            code="context_length_exceeded",
        )
    sampling = msgspec.structs.replace(request.sampling, max_tokens=max_tokens)
    _check_options(sampling, tokenizer.vocab_size)
    if sampling.prompt_logprobs is not None:
        size = len(ids) * (1 + sampling.prompt_logprobs)
        if size > MAX_PROMPT_SCORES:
            raise InvalidRequestError(
                f"prompt logprobs (echo with logprobs, or prompt_logprobs) of {len(ids)} tokens "
                f"with {sampling.prompt_logprobs} alternatives each are {size} entries, more "
                f"than the {MAX_PROMPT_SCORES} a request may have; shorten the prompt or ask "
                "for fewer",
                param="prompt_logprobs" if request.returns_prompt_logprobs else "echo",
                code="invalid_value",
            )
    return Prompt(prompt_ids=ids, sampling=sampling)


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: ToolUse | None,
    tool_parser: str,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The ids of ``messages`` and ``tools`` through the chat template (tool_prompt.py); a
    template's refusal is a 400."""
    shown, context = chat_inputs(messages, tools, tokenizer.chat_template, tool_parser)
    try:
        return tokenizer.encode_chat(shown, add_generation_prompt, **context)
    except TokenizerError as exc:
        raise InvalidRequestError(str(exc), param="messages") from None


def _check_options(sampling: SamplingOptions, vocab_size: int) -> None:
    """What needs the vocabulary or the final max_tokens to check."""
    for name, ids in (
        ("stop_token_ids", sampling.stop_token_ids),
        ("logit_bias", sampling.logit_bias),
    ):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"'{name}' names token id {bad}, outside the vocabulary (size {vocab_size})",
                param=name,
                code="invalid_value",
            )
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"'min_tokens' ({sampling.min_tokens}) is more than the output may have "
            f"({sampling.max_tokens} tokens: max_tokens, or what the context leaves)",
            param="min_tokens",
            code="invalid_value",
        )
