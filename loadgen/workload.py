"""What a serving benchmark sends: prompts of exact token lengths and their output lengths.

Pure given a tokenizer and a ``random.Random``: the same seed gives the same prompts.

- Random prompts draw token ids from the tokenizer's *pool*: the ids that decode to text which
  encodes back to that id alone (this leaves out special tokens and partial UTF-8 bytes), so a
  prompt of n ids is n tokens to the server whether it is sent as ids or as text. Sent as text,
  the decoded string is re-encoded and trimmed or topped up until it is n tokens again (tokens may
  merge across boundaries); the few that never settle keep their true length.
- ShareGPT prompts are the first turn of each conversation, the second turn's length being the
  output length (unless one is fixed), filtered as vLLM filters them (prompt and reply >= 4
  tokens, prompt <= 1024, both <= 2048).
- Lengths come from ``LengthSpec``: uniform over [low, high] (a ratio around a length, or explicit
  bounds), or from ``length_dist`` (normal, log-normal, clipped); optionally a fraction of prompts
  is a fixed long length, to see long prefills arrive. Text cut from a corpus: ``corpus``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

MIN_SHAREGPT_LEN = 4
MAX_SHAREGPT_PROMPT_LEN = 1024
MAX_SHAREGPT_TOTAL_LEN = 2048
_FIT_TRIES = 8


class WorkloadError(ValueError):
    """A workload that cannot be built as asked (bad length range, unusable dataset file)."""


class LengthSampler(Protocol):
    """Draws one length: ``LengthSpec`` (uniform) or ``length_dist.LengthDistribution``."""

    def sample(self, rng: random.Random) -> int: ...


class TokenizerLike(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class WorkloadPrompt:
    """One request's prompt: ``token_ids`` always (its length is the input length), ``text`` when
    it is to be sent as text (chat endpoint, datasets, ``--prompt-format text``)."""

    token_ids: tuple[int, ...]
    output_len: int
    text: str | None = None

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """Lengths uniform over [low, high] (inclusive)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise WorkloadError(f"length range must satisfy 1 <= low <= high, got {self}")

    @classmethod
    def parse(cls, length: int, spread: str | None = None) -> LengthSpec:
        """``length`` alone: exactly that. ``spread`` "R" (0 <= R < 1): uniform over
        [length*(1-R), length*(1+R)]; "MIN:MAX": uniform over [MIN, MAX] (``length`` unused)."""
        if spread is None or not spread.strip():
            return cls(length, length)
        if ":" in spread:
            low_text, high_text = spread.split(":", 1)
            try:
                return cls(int(low_text), int(high_text))
            except ValueError:
                raise WorkloadError(f"length range {spread!r}: expected MIN:MAX integers") from None
        try:
            ratio = float(spread)
        except ValueError:
            raise WorkloadError(
                f"length range {spread!r}: expected a ratio in [0, 1) or MIN:MAX"
            ) from None
        if not 0 <= ratio < 1:
            raise WorkloadError(f"length range ratio must be in [0, 1), got {ratio}")
        return cls(max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio)))

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


def sample_lengths(
    num: int,
    input_lens: LengthSampler,
    output_lens: LengthSampler,
    rng: random.Random,
    *,
    long_input_len: int | None = None,
    long_fraction: float = 0.0,
) -> list[tuple[int, int]]:
    """``num`` (input_len, output_len) pairs; each input is ``long_input_len`` with probability
    ``long_fraction``, else drawn from ``input_lens``."""
    if not 0 <= long_fraction <= 1:
        raise WorkloadError(f"long fraction must be in [0, 1], got {long_fraction}")
    if long_fraction and (long_input_len is None or long_input_len < 1):
        raise WorkloadError("a long fraction needs a long input length >= 1")
    pairs = []
    for _ in range(num):
        is_long = long_fraction > 0 and rng.random() < long_fraction
        n = long_input_len if is_long and long_input_len else input_lens.sample(rng)
        pairs.append((n, output_lens.sample(rng)))
    return pairs


def token_pool(tokenizer: TokenizerLike) -> tuple[int, ...]:
    """Ids that decode to text that encodes back to exactly that id."""
    pool = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text and tokenizer.encode(text, add_special_tokens=False) == [i]:
            pool.append(i)
    if not pool:
        raise WorkloadError("no token of this tokenizer survives decode + encode on its own")
    return tuple(pool)


def random_prompts(
    tokenizer: TokenizerLike,
    lengths: Sequence[tuple[int, int]],
    rng: random.Random,
    *,
    as_text: bool,
    pool: Sequence[int] | None = None,
) -> list[WorkloadPrompt]:
    """One prompt of random pool tokens per (input_len, output_len)."""
    pool = pool or token_pool(tokenizer)
    prompts = []
    for input_len, output_len in lengths:
        ids = [pool[rng.randrange(len(pool))] for _ in range(input_len)]
        if as_text:
            text, fitted = fit_text(tokenizer, ids, pool, rng)
            prompts.append(WorkloadPrompt(fitted, output_len, text))
        else:
            prompts.append(WorkloadPrompt(tuple(ids), output_len))
    return prompts


def fit_text(
    tokenizer: TokenizerLike, ids: Sequence[int], pool: Sequence[int], rng: random.Random
) -> tuple[str, tuple[int, ...]]:
    """Text that encodes to ``len(ids)`` tokens (when a few rounds of trimming and topping up
    get there), with the ids it encodes to."""
    target = len(ids)
    current = list(ids)
    for _ in range(_FIT_TRIES):
        text = tokenizer.decode(current, skip_special_tokens=True)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        current = encoded[:target] + [
            pool[rng.randrange(len(pool))] for _ in range(target - len(encoded))
        ]
    return text, tuple(encoded)


def parse_sharegpt(data: Any, source: str = "<sharegpt>") -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two text turns. Accepts
    ``conversations``/``conversation`` lists of ``{"from"|"role", "value"|"content"}``."""
    if not isinstance(data, list):
        raise WorkloadError(f"{source}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = (
            entry.get("conversations", entry.get("conversation"))
            if isinstance(entry, dict)
            else None
        )
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [_turn_text(t) for t in turns[:2]]
        if all(isinstance(t, str) and t for t in texts):
            pairs.append((texts[0], texts[1]))
    if not pairs:
        raise WorkloadError(f"{source}: no conversation with two text turns (ShareGPT format)")
    return pairs


def _turn_text(turn: Any) -> str | None:
    if not isinstance(turn, dict):
        return None
    return turn.get("value", turn.get("content"))


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    path = Path(path)
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the dataset ({exc.strerror})") from None
    except orjson.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not JSON ({exc})") from None
    return parse_sharegpt(data, str(path))


def sharegpt_prompts(
    tokenizer: TokenizerLike,
    pairs: Sequence[tuple[str, str]],
    num: int,
    rng: random.Random,
    *,
    output_len: int | None = None,
) -> list[WorkloadPrompt]:
    """``num`` prompts from the conversations in a seeded random order; when fewer pass the
    filters, the accepted ones repeat in that order."""
    order = list(range(len(pairs)))
    rng.shuffle(order)
    accepted: list[WorkloadPrompt] = []
    for i in order:
        if len(accepted) == num:
            break
        question, answer = pairs[i]
        ids = tokenizer.encode(question)
        n_out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if len(ids) < MIN_SHAREGPT_LEN or (output_len is None and n_out < MIN_SHAREGPT_LEN):
            continue
        if len(ids) > MAX_SHAREGPT_PROMPT_LEN or len(ids) + n_out > MAX_SHAREGPT_TOTAL_LEN:
            continue
        accepted.append(WorkloadPrompt(tuple(ids), n_out, question))
    if not accepted:
        raise WorkloadError(
            f"none of {len(pairs)} conversations passes the length filters (prompt and reply >= "
            f"{MIN_SHAREGPT_LEN} tokens, prompt <= {MAX_SHAREGPT_PROMPT_LEN}, both <= "
            f"{MAX_SHAREGPT_TOTAL_LEN})"
        )
    return [accepted[i % len(accepted)] for i in range(num)]
