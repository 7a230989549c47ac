"""Stop strings over streamed text: text in, the part safe to show out (pure).

Text from the first stop string on is cut (OpenAI semantics: the stop string is not part of the
output); a tail that could still become a stop string is held back until more text settles it
or the stream ends. Of the stop strings completed by one ``add``, the one that starts first
wins (with ``include_stop``, the longest stop string starting there ends the text).

One Aho-Corasick automaton over the stop strings reads each character once: its state is the
longest tail of the text that begins a stop string, which is also the text held back. The work
per character is bounded (amortized) whatever the stop strings' lengths; before, each token
rescanned the longest stop string's length of tail per stop string and per tail length, and 16
stop strings of 4,096 characters cost 3.5 s of decode CPU per 2,000 tokens (issue 40).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class _Automaton:
    """The stop strings' trie with failure links; state 0 is the root (nothing matched)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]  # characters of a stop string's prefix the state stands for
        self.fail = [0]  # the state of the longest proper suffix that is also a prefix
        self.longest = [0]  # the longest stop string ending at this state (via fail links)
        for s in stop:
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = self.goto[state][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.fail.append(0)
                    self.longest.append(0)
                state = nxt
            self.longest[state] = len(s)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's fail link is shallower, so already done
            state = queue.popleft()
            self.longest[state] = max(self.longest[state], self.longest[self.fail[state]])
            for ch, nxt in self.goto[state].items():
                queue.append(nxt)
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[nxt] = self.goto[f].get(ch, 0) if state else 0


class StopMatcher:
    """Feed text with ``add``; each call returns the new text safe to show."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        assert all(stop), "stop strings are non-empty"
        self._stop = tuple(stop)
        self._include_stop = include_stop  # the text ends after the stop string, not before
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._automaton = _Automaton(self._stop)
        self._state = 0
        self._num_added = 0  # characters added so far (cut at a stop string)
        self._tail = ""  # the last max_stop_len of them: a match or held-back text is in it
        self._released: list[str] = []
        self._num_released = 0  # characters already returned
        self.num_steps = 0  # automaton moves so far (the matcher's work, for tests)
        self.is_stopped = False  # a stop string matched; nothing more is returned

    @property
    def text(self) -> str:
        """The text returned so far."""
        return "".join(self._released)

    def add(self, text: str) -> str:
        return self._advance(text, is_final=False)

    def finish(self, text: str = "") -> str:
        """The end of the stream: ``text`` is the last, and held-back text is released."""
        return self._advance(text, is_final=True)

    def _advance(self, text: str, *, is_final: bool) -> str:
        if self.is_stopped:
            return ""
        window = self._tail + text  # (tail, then the new text)
        base = self._num_added - len(self._tail)  # the window's first character in the text
        cut = self._find_stop(text, self._num_added)
        if cut is not None:
            self.is_stopped = True
            if self._include_stop:
                cut += max(len(s) for s in self._stop if window.startswith(s, cut - base))
            end = cut
        else:
            self._num_added += len(text)
            self._tail = window[max(0, len(window) - self._max_stop_len) :]
            held = 0 if is_final else self._automaton.depth[self._state]
            end = self._num_added - held
        end = max(end, self._num_released)
        delta = window[self._num_released - base : end - base]
        self._num_released = end
        self._released.append(delta)
        return delta

    def _find_stop(self, text: str, offset: int) -> int | None:
        """Run the automaton over ``text`` (starting at ``offset`` in the whole text): the start
        of the first-starting stop string that ends in it, or None (the state moves on)."""
        a, state, steps = self._automaton, self._state, 0
        best: int | None = None
        for i, ch in enumerate(text):
            if best is not None and offset + i + 1 - self._max_stop_len >= best:
                break  # a later match cannot start before this one
            while state and ch not in a.goto[state]:
                state = a.fail[state]
                steps += 1
            state = a.goto[state].get(ch, 0)
            steps += 1
            if a.longest[state]:
                start = offset + i + 1 - a.longest[state]
                best = start if best is None else min(best, start)
        self._state = state
        self.num_steps += steps
        return best


__all__ = ["StopMatcher"]
