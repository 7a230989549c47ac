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
- ``StopMatcher``: text in, the part safe to show out. Text from the first stop string on is cut
  (OpenAI semantics: the stop string is not part of the output); a tail that could still become a
  stop string is held back until more text settles it or the stream ends.
- ``TextStream``: the two in a row.

Torch-free: the tokenizer is anything with ``decode(ids, skip_special_tokens)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

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


class StopMatcher:
    """Feed text with ``add``; each call returns the new text safe to show."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        assert all(stop), "stop strings are non-empty"
        self._stop = tuple(stop)
        self._include_stop = include_stop  # the text ends after the stop string, not before
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""  # everything added so far (cut at a stop string)
        self._num_released = 0  # characters of _text already returned
        self._num_searched = 0  # characters of _text already known to hold no full match
        self.is_stopped = False  # a stop string matched; nothing more is returned

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._num_released]

    def add(self, text: str) -> str:
        return self._advance(text, is_final=False)

    def finish(self, text: str = "") -> str:
        """The end of the stream: ``text`` is the last, and held-back text is released."""
        return self._advance(text, is_final=True)

    def _advance(self, text: str, *, is_final: bool) -> str:
        if self.is_stopped:
            return ""
        self._text += text
        cut = self._find_stop()
        if cut is not None:
            self.is_stopped = True
            if self._include_stop:
                cut += max(len(s) for s in self._stop if self._text.startswith(s, cut))
            self._text = self._text[:cut]
            end = cut
        elif is_final:
            end = len(self._text)
        else:
            end = len(self._text) - self._num_held_back()
        end = max(end, self._num_released)
        delta = self._text[self._num_released : end]
        self._num_released = end
        return delta

    def _find_stop(self) -> int | None:
        if not self._stop or len(self._text) == self._num_searched:
            return None
        # A match may begin up to (longest stop - 1) characters before the new text.
        start = max(0, self._num_searched - self._max_stop_len + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        self._num_searched = len(self._text)
        return min(hits) if hits else None

    def _num_held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


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
