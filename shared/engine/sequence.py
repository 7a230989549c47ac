"""A request inside the engine: its tokens, its place in the KV cache, how to sample it.

``Sequence.token_ids`` holds prompt and output tokens; the first ``num_computed_tokens`` of them
have their K/V in the blocks of ``block_table``. A decoding sequence has exactly one uncomputed
token (the last sampled one), a sequence in prefill has more; after a preemption the outputs are
recomputed as if they were prompt.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs

if TYPE_CHECKING:
    from kvmesh.shared.text.detokenize import TextStream


class RequestError(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


class PromptTooLongError(RequestError):
    pass


class UnknownRequestError(RequestError):
    pass


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class ChunkReady:
    """A prefill chunk of a ``prefill_only`` request is in the KV cache (all layers).

    Tokens ``[start_token, end_token)`` are done; ``block_ids`` are the blocks that became complete
    with this chunk (the last chunk includes the partial last block). ``first_token`` is set on the
    last chunk."""

    request_id: str
    chunk_index: int
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]
    is_last: bool
    first_token: int | None
    first_logprobs: TokenLogprobs | None = None  # with SamplingOptions.logprobs, on the last
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with .prompt_logprobs, on the last


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one ``step()`` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefill_done"
    num_prompt_tokens: int
    num_output_tokens: int
    accepted_drafts: int = (
        0  # draft tokens verified and kept this step (their ids lead new_token_ids)
    )
    logprobs: list[TokenLogprobs] | None = None  # per new token, with SamplingOptions.logprobs
    index: int = 0  # which of the request's SamplingOptions.n choices
    # with SamplingOptions.prompt_logprobs, on the request's first output: of prompt tokens 1..
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingOptions
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    prefill_only: bool = False
    on_chunk: Callable[[ChunkReady], Any] | None = None
    num_chunks: int = 0
    num_reported_tokens: int = 0  # prefill_only: tokens handed to on_chunk so far
    num_reported_blocks: int = 0
    num_emitted_tokens: int = 0  # output tokens already returned in a RequestOutput
    generator: torch.Generator | None = None
    stop_text: TextStream | None = None  # the emitted output's text, only with stop strings
    # with SamplingOptions.logprobs: one per output token, in order
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with SamplingOptions.prompt_logprobs: of prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with SamplingOptions.structured_outputs: an xgrammar GrammarMatcher (grammar.py) that has
    # accepted every output token
    grammar: Any = None
    # choice ``index`` > 0 of the request ``choice_of`` (SamplingOptions.n; choices.py)
    choice_of: str | None = None
    index: int = 0

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        self.num_emitted_tokens = len(self.token_ids) - self.num_prompt_tokens
        if self.seed is not None and not self.params.is_greedy:
            self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def seed(self) -> int | None:
        """The seed of this choice's noise: the request's for choice 0, one drawn from it for
        the others (each choice samples differently, reproducibly)."""
        if self.params.seed is None or self.index == 0:
            return self.params.seed
        return choice_seed(self.params.seed, self.index)

    @property
    def is_scored(self) -> bool:
        """Every prompt token but the first has its log-probability (prompt_logprobs)."""
        return len(self.prompt_logprobs) >= self.num_prompt_tokens - 1

    @property
    def reply_id(self) -> str:
        """The request this sequence answers (its own id but for choices > 0)."""
        return self.choice_of or self.request_id

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed from the request's (a splitmix64 mix, 63 bits)."""
    z = (seed * 0xD1B54A32D192ED03 + index * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    return (z ^ (z >> 27)) >> 1
