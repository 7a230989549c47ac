"""``/tokenize`` and ``/detokenize`` as vLLM serves them (pure: bodies in, answers out).

``/tokenize`` takes a text ``prompt`` (with the tokenizer's special tokens unless
``add_special_tokens`` is false) or chat ``messages`` (through the chat template, as a chat
request is), and answers the token ids, their count and the context a request can use;
``return_token_strs`` adds each token's text. ``/detokenize`` turns ``tokens`` back into text.
The model, if named, must be the served one; any other field is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.services.router.api import (
    chat_messages,
    check_model,
    refuse_non_text_parts,
    refuse_unknown,
)
from kvmesh.services.router.errors import InvalidRequestError
from kvmesh.services.router.prompt import encode_chat
from kvmesh.services.router.request_bodies import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvmesh.services.router.response_bodies import DetokenizeResponse, TokenizeResponse
from kvmesh.services.router.validation import validate_body
from kvmesh.shared.text.tokenizer import Tokenizer


def tokenize_body(
    body: Mapping[str, Any],
    served_model: str,
    tokenizer: Tokenizer,
    max_model_len: int,
    tool_parser: str = "hermes",
) -> TokenizeResponse:
    cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    refuse_unknown(body, cls, {}, {})
    if body.get("model") is not None:
        check_model(body["model"], served_model)
    if cls is TokenizeChatRequest:
        refuse_non_text_parts(body.get("messages"))
        chat = validate_body(body, TokenizeChatRequest)
        messages = chat_messages(chat.messages)
        ids = encode_chat(tokenizer, messages, None, tool_parser, chat.add_generation_prompt)
        return_strs = chat.return_token_strs
    else:
        text = validate_body(body, TokenizeCompletionRequest)
        ids = tokenizer.encode(text.prompt, add_special_tokens=text.add_special_tokens)
        return_strs = text.return_token_strs
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if return_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
    )


def detokenize_body(
    body: Mapping[str, Any], served_model: str, tokenizer: Tokenizer
) -> DetokenizeResponse:
    refuse_unknown(body, DetokenizeRequest, {}, {})
    if body.get("model") is not None:
        check_model(body["model"], served_model)
    req = validate_body(body, DetokenizeRequest)
    bad = next((t for t in req.tokens if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary (size {tokenizer.vocab_size})",
            param="tokens",
        )
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))
