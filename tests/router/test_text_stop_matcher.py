"""The stop matcher's automaton against the rescanning matcher it replaced (issue 40): the same
text out on random stop strings and chunkings, and work linear in the text, not quadratic in the
stop strings' length."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.shared.text.stop_matcher import StopMatcher


class RescanningStopMatcher:
    """The matcher before issue 40, verbatim but for its name: the reference semantics."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._num_released = 0
        self._num_searched = 0
        self.is_stopped = False

    @property
    def text(self) -> str:
        return self._text[: self._num_released]

    def add(self, text: str) -> str:
        return self._advance(text, is_final=False)

    def finish(self, text: str = "") -> str:
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
        start = max(0, self._num_searched - self._max_stop_len + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        self._num_searched = len(self._text)
        return min(hits) if hits else None

    def _num_held_back(self) -> int:
        for k in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


def _run(matcher, chunks: list[str], finish: bool) -> tuple[list[str], str, bool]:
    out = [matcher.add(c) for c in chunks]
    if finish:
        out.append(matcher.finish())
    return out, matcher.text, matcher.is_stopped


ALPHABET = "abc "


@settings(max_examples=400, deadline=None)
@given(
    stop=st.lists(st.text(ALPHABET, min_size=1, max_size=6), max_size=5),
    chunks=st.lists(st.text(ALPHABET, max_size=8), max_size=12),
    include_stop=st.booleans(),
    finish=st.booleans(),
)
def test_stop_matcher_returns_what_the_rescanning_matcher_returned_on_random_streams(
    stop: list[str], chunks: list[str], include_stop: bool, finish: bool
) -> None:
    new = _run(StopMatcher(stop, include_stop), chunks, finish)
    old = _run(RescanningStopMatcher(stop, include_stop), chunks, finish)
    assert new == old


def test_stop_matcher_returns_what_the_rescanning_matcher_returned_on_overlapping_stops() -> None:
    rng = random.Random(40)
    for _ in range(2000):
        stop = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choices("ab", k=rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include_stop = rng.random() < 0.5
        new = _run(StopMatcher(stop, include_stop), chunks, True)
        old = _run(RescanningStopMatcher(stop, include_stop), chunks, True)
        assert new == old, (stop, chunks, include_stop)


def test_stop_matcher_work_is_linear_in_the_text_with_long_stop_strings() -> None:
    """16 stop strings of 4,096 characters, 2,000 tokens: the work per character is bounded by
    a constant, not by the stop strings' length (before: each token rescanned about 4,096
    tails against each stop string)."""
    rng = random.Random(5)
    stop = ["a" * 4095 + c for c in "bcdefghijklmnopq"]  # every tail of a's could become one
    tokens = ["a" * rng.randint(1, 4) for _ in range(2000)]
    matcher = StopMatcher(stop)
    held = [matcher.add(t) for t in tokens]
    total = sum(len(t) for t in tokens)
    assert matcher.num_steps <= 2 * total
    assert not matcher.is_stopped and "".join(held) == "a" * (total - 4095)
    # work for twice the text is about twice the work
    twice = StopMatcher(stop)
    for t in tokens + tokens:
        twice.add(t)
    assert twice.num_steps <= 2 * matcher.num_steps + 4096


def test_stop_matcher_work_stays_linear_when_failure_links_are_walked() -> None:
    rng = random.Random(6)
    stop = ["".join(rng.choices("ab", k=4096)) for _ in range(16)]
    text = "".join(rng.choices("ab", k=20_000))
    matcher = StopMatcher(stop)
    for i in range(0, len(text), 7):
        matcher.add(text[i : i + 7])
    assert matcher.num_steps <= 2 * len(text)
    assert not matcher.is_stopped and text.startswith(matcher.text)
    assert len(matcher.text) >= len(text) - 4095
