"""Token log-probabilities from the mesh (``TokenLogprobs``) in OpenAI's two shapes (pure).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, one entry per
token, ``bytes`` the token's own bytes (``Tokenizer.token_bytes``: the bytes of a multi-byte
character split over tokens add up across entries). Completions (the legacy shape): parallel lists ``tokens``, ``token_logprobs``,
``top_logprobs`` (text -> logprob of the likeliest tokens and the chosen one, as vLLM gives it)
and ``text_offset`` (where each token's text starts in the choice's text). A token's text is the
token decoded alone, special tokens included; one byte of a multi-byte character decodes to
U+FFFD, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.services.router.response_bodies import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from kvmesh.shared.text.sampling import TokenLogprobs
from kvmesh.shared.text.tokenizer import Tokenizer


class LogprobsBuilder:
    """The logprobs of one choice, chunk by chunk (a stream's chunks continue its offsets)."""

    def __init__(self, tokenizer: Tokenizer, is_chat: bool) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        self._texts: dict[int, str] = {}
        self.text_offset = 0  # completions: where the next token's text starts

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def build(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
    ) -> ChatLogprobs | CompletionLogprobs:
        """The shape of this choice's kind for these tokens (``None``: a prompt token without
        a log-probability, the first one of an echoed prompt)."""
        assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
        if self._is_chat:
            entries = zip(token_ids, logprobs, strict=True)
            return ChatLogprobs(content=[self._chat_entry(t, lp) for t, lp in entries])
        tokens, values, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(lp.logprob)
            top = {self.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
            top.setdefault(text, lp.logprob)
            tops.append(top)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    def _chat_entry(self, token_id: int, lp: TokenLogprobs | None) -> TokenLogprob:
        assert lp is not None, "only an echoed prompt has tokens without logprobs"
        text = self.token_text(token_id)
        top = [
            TopLogprob(token=self.token_text(i), logprob=v, bytes=self._bytes(i))
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        ]
        return TokenLogprob(
            token=text, logprob=lp.logprob, bytes=self._bytes(token_id), top_logprobs=top
        )

    def _bytes(self, token_id: int) -> list[int]:
        return list(self._tokenizer.token_bytes(token_id))


def prompt_logprobs(
    builder: LogprobsBuilder, prompt_ids: Sequence[int], scored: Sequence[TokenLogprobs]
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token
    ``{id: {logprob, rank, decoded_token}}`` of the token itself and its position's likeliest."""
    assert len(scored) == len(prompt_ids) - 1, (len(scored), len(prompt_ids))
    out: PromptLogprobs = [None]
    for token_id, lp in zip(prompt_ids[1:], scored, strict=True):
        entry = {
            str(i): PromptLogprob(logprob=v, rank=r + 1, decoded_token=builder.token_text(i))
            for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))
        }
        entry[str(token_id)] = PromptLogprob(
            logprob=lp.logprob, rank=lp.rank or None, decoded_token=builder.token_text(token_id)
        )
        out.append(entry)
    return out
