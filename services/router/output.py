"""Generated token ids -> the text a client sees, with stop strings applied (pure).

The decode worker may stop at a stop string itself, but its tokens still carry the whole token
that completed the match, so the router applies ``stop`` on the text in every case: text from the
start of the first match on is dropped, and text that could still become a match is held back
until the next token settles it, so a stream never shows a stop string's prefix it has to take
back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh.shared.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """Feed token ids with ``add``; each call returns the new text safe to send."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""  # everything decoded so far (until a stop string)
        self._num_sent = 0  # characters of _text already returned
        self._num_searched = 0  # characters of _text already known to hold no full match
        self.is_stopped = False  # a stop string matched; nothing more is returned
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._num_sent]

    def add(self, token_ids: Iterable[int]) -> str:
        if self.is_stopped:
            return ""
        for token_id in token_ids:
            self.num_tokens += 1
            self._text += self._detokenizer.add(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """The end of the stream: flush held-back text (no more tokens will settle it)."""
        if not self.is_stopped:
            self._text += self._detokenizer.finish()
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self.is_stopped:
            return ""
        cut = self._find_stop()
        if cut is not None:
            self.is_stopped = True
            self._text = self._text[:cut]
            end = cut
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        end = max(end, self._num_sent)
        delta = self._text[self._num_sent : end]
        self._num_sent = end
        return delta

    def _find_stop(self) -> int | None:
        if not self._stop:
            return None
        # A match may begin up to (longest stop - 1) characters before the new text.
        start = max(0, self._num_searched - self._max_stop_len + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        self._num_searched = len(self._text)
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
