"""Generated token ids -> the text a client sees: incremental detokenizing and stop strings (pure).

One pipeline for every side that needs text. The router streams ``TextStream`` deltas to clients;
the decode engine feeds its stop-string requests' tokens through the same ``TextStream`` and ends
a request at the token whose text completes a stop string (requests without stop strings are never
detokenized there). Both sides therefore see the same text and stop at the same token; the router
still cuts the text itself, because that last token may carry text past the match.

- ``IncrementalDetokenizer``: ids in, text out, one token at a time. It decodes a short window of
  recent ids and emits what lies past the text already emitted, so tokenizers that drop a leading
  space at the start of a decode (SentencePiece) and UTF-8 characters split over several byte
  tokens both come out as the full decode would.
- ``StopMatcher`` (``stop_matcher.py``): text in, the part safe to show out. Text from the first
  stop string on is cut (OpenAI semantics: the stop string is not part of the output); a tail
  that could still become a stop string is held back until more text settles it or the stream
  ends.
- ``TextStream``: the two in a row.

Torch-free: the tokenizer is anything with ``decode(ids, skip_special_tokens)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvmesh.shared.text.stop_matcher import StopMatcher

# Prompt ids kept as decoding context for the first output token (a leading space of a
# SentencePiece token only shows after another token).
NUM_CONTEXT_IDS = 6


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed generated token ids one by one; get back the text each adds."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # _ids[:_read_offset] is context whose text was emitted already; _ids[_read_offset:] is not.
        self._ids: list[int] = list(prompt_ids[-NUM_CONTEXT_IDS:])
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token id; return the new text it completes ("" if it is held back)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or a skipped special): wait for more tokens
        return self._emit(new_text[len(prefix_text) :])

    def finish(self) -> str:
        """Flush text held back at the end of the stream (an unfinished character becomes U+FFFD)."""
        prefix_text, new_text = self._decode_window()
        return self._emit(new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else "")

    def _decode_window(self) -> tuple[str, str]:
        """The text of the context ids, and of the context and pending ids together."""
        decode = self._tokenizer.decode
        return decode(self._ids[: self._read_offset], self._skip), decode(self._ids, self._skip)

    def _emit(self, delta: str) -> str:
        # Keep the window short: the ids just emitted are the next token's only context.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class TextStream:
    """Generated token ids in, client text out: ``IncrementalDetokenizer`` then ``StopMatcher``."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._matcher = StopMatcher(stop, include_stop)
        self.num_tokens = 0  # token ids added

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._matcher.text

    @property
    def is_stopped(self) -> bool:
        """A stop string matched: the text ends before it and nothing more is returned."""
        return self._matcher.is_stopped

    def add(self, token_ids: Iterable[int]) -> str:
        """Append token ids; return the new text safe to send ("" once stopped)."""
        if self.is_stopped:
            return ""
        parts = []
        for token_id in token_ids:
            self.num_tokens += 1
            parts.append(self._detokenizer.add(token_id))
        return self._matcher.add("".join(parts))

    def finish(self) -> str:
        """The end of the stream: flush held-back text (no more tokens will settle it)."""
        if self.is_stopped:
            return ""
        return self._matcher.finish(self._detokenizer.finish())
