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

if TYPE_CHECKING:
    from kvmesh.shared.protocol import SamplingOptions
    from kvmesh.shared.text import TextStream


class RequestError(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


class PromptTooLongError(RequestError):
    pass


class UnknownRequestError(RequestError):
    pass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick output tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters; ``seed`` makes sampling reproducible per request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        # Accept lists from callers but store tuples so the params stay hashable and frozen.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(
            self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_wire(cls, o: SamplingOptions) -> SamplingParams:
        """From the NATS form (``protocol.SamplingOptions``); top_k 0 is off in both."""
        return cls(
            max_tokens=o.max_tokens,
            temperature=o.temperature,
            top_k=o.top_k,
            top_p=o.top_p,
            seed=o.seed,
            stop_token_ids=o.stop_token_ids,
            stop=o.stop,
            ignore_eos=o.ignore_eos,
        )


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


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
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

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        self.num_emitted_tokens = len(self.token_ids) - self.num_prompt_tokens
        if self.params.seed is not None and not self.params.is_greedy:
            self.generator = torch.Generator().manual_seed(self.params.seed)

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
