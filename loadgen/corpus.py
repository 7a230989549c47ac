"""Text prompts cut from a corpus to exact token lengths (pure given a tokenizer and a
``random.Random``: the same seed gives the same prompts).

The corpus is tokenized once; a prompt of n tokens starts at a random token of it and runs on for
n tokens (past the end, the corpus starts again), is decoded to text, and re-encoded. A span cut
inside a character or a merge may not encode back to n tokens: then the span starts a token later
(a few times), and failing that it is trimmed or topped up with the corpus's next tokens until it
encodes to n tokens (as ``workload.fit_text``; the rare prompt that never settles keeps its true
length). A server therefore sees natural text whose token count is the one drawn.

The shipped corpus (``loadgen/data/shakespeare.txt``) is the first 256 KB of the Tiny
Shakespeare text of karpathy/char-rnn: Shakespeare's plays, public domain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvmesh.loadgen.workload import TokenizerLike, WorkloadError, WorkloadPrompt

DEFAULT_CORPUS = Path(__file__).parent / "data" / "shakespeare.txt"
_FIT_TRIES = 8


@dataclass(frozen=True, slots=True)
class Corpus:
    """A text as token ids of one tokenizer."""

    token_ids: tuple[int, ...]
    source: str = "<corpus>"

    @classmethod
    def from_text(cls, tokenizer: TokenizerLike, text: str, source: str = "<corpus>") -> Corpus:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise WorkloadError(f"{source}: the corpus holds no text to cut prompts from")
        return cls(ids, source)

    @classmethod
    def load(cls, tokenizer: TokenizerLike, path: str | Path = DEFAULT_CORPUS) -> Corpus:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise WorkloadError(f"{path}: cannot read the corpus ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise WorkloadError(f"{path}: the corpus is not UTF-8 text") from None
        return cls.from_text(tokenizer, text, str(path))

    def span(self, start: int, num_tokens: int) -> list[int]:
        """``num_tokens`` ids from ``start``, wrapping round at the end."""
        n = len(self.token_ids)
        return [self.token_ids[(start + i) % n] for i in range(num_tokens)]

    def prompt(
        self, tokenizer: TokenizerLike, num_tokens: int, output_len: int, rng: random.Random
    ) -> WorkloadPrompt:
        """A text prompt of ``num_tokens`` tokens from a random place in the corpus."""
        assert num_tokens >= 1
        start = rng.randrange(len(self.token_ids))
        # A span that starts or ends inside a character or a merge does not encode back to its
        # length; the next places in the corpus usually do.
        for shift in range(_FIT_TRIES):
            text = tokenizer.decode(self.span(start + shift, num_tokens), skip_special_tokens=True)
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                return WorkloadPrompt(tuple(encoded), output_len, text)
        ids = self.span(start, num_tokens)
        extra = num_tokens  # where topping up reads on from
        for _ in range(_FIT_TRIES):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                break
            missing = num_tokens - len(encoded)
            ids = encoded[:num_tokens] + self.span(start + extra, max(0, missing))
            extra += max(0, missing)
        return WorkloadPrompt(tuple(encoded), output_len, text)

    def prompts(
        self, tokenizer: TokenizerLike, lengths: list[tuple[int, int]], rng: random.Random
    ) -> list[WorkloadPrompt]:
        """One prompt per (input_len, output_len)."""
        return [self.prompt(tokenizer, n, out, rng) for n, out in lengths]
