"""A simulated engine worker: what its next step computes, and what that step leaves done.

Pure state, no clock of its own: the cluster asks ``plan()`` for the next step's batch, runs it
for as long as the cost model says, then calls ``complete(batch, now)``, which returns the
sequences whose prompt just finished and those that finished for good. Roles:

- ``colocated``: continuous batching as kvmesh's scheduler does it: running decodes first (one
  token each), then unfinished prompts take chunks of what is left of ``chunk_tokens``, then
  waiting sequences are admitted while the budget and ``max_num_seqs`` allow (``chunk_tokens``
  None: no budget, whole prompts in one step beside the decodes); a step with no decode in it
  gives the oldest prompt up to ``no_decode_tokens`` (no more than it has left), as the
  scheduler's ``max_num_batched_tokens_no_decode`` does;
- ``prefill``: up to ``max_jobs`` jobs share a chunk budget of ``chunk_tokens`` per step; a job
  stops computing when its last chunk is computed, but holds its slot until its last write has
  landed (``sending``; the service releases the slot when ``prefill()`` returns). With
  ``block_tokens``, chunks are hand-off chunks as the engine cuts them: whole blocks, and the
  last one, after a first, at most one block (so that only one block's write is exposed: a
  1,000-token prompt in 512-token chunks is 512 + 480 + 8);
- ``decode``: every running sequence decodes one token per step; sequences whose KV has arrived
  are admitted at step boundaries while ``max_num_seqs`` allows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.sim.cost import Slice

Role = Literal["colocated", "prefill", "decode"]


@dataclass(slots=True)
class SimSeq:
    """One request's progress: prompt tokens whose KV exists, and its token times."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    num_computed: int = 0
    token_times: list[float] = field(default_factory=list)
    home: int = -1  # index of the colocated or decode worker holding its KV reservation
    pace: float = 1.0  # its decode steps' cost against the mean (CostModel.pace)

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def is_finished(self) -> bool:
        return len(self.token_times) >= self.output_len

    @property
    def kv_tokens(self) -> int:
        """What its reservation holds: the prompt and every output token."""
        return self.prompt_len + self.output_len

    def decode_slice(self) -> Slice:
        # the newest token goes in; every earlier token's KV is cached
        return Slice(1, self.prompt_len + len(self.token_times) - 1)


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's share of a step: ``num_new`` tokens (prompt tokens, or one decode)."""

    seq: SimSeq
    num_new: int
    is_prefill: bool

    @property
    def emits_token(self) -> bool:
        """Whether this work streams a token at the step's end (a decode, or a colocated
        prompt's last chunk). Read before the step is applied."""
        return not self.is_prefill or self.seq.num_computed + self.num_new >= self.seq.prompt_len

    def slice(self) -> Slice:
        if self.is_prefill:
            return Slice(self.num_new, self.seq.num_computed)
        return self.seq.decode_slice()


@dataclass(frozen=True, slots=True)
class StepOutcome:
    prefilled: list[SimSeq]  # prompt finished this step
    finished: list[SimSeq]  # every output token produced


class Worker:
    def __init__(
        self,
        index: int,
        role: Role,
        *,
        chunk_tokens: int | None,
        max_num_seqs: int,
        max_jobs: int = 1,
        kv_capacity: int = 0,
        block_tokens: int | None = None,
        no_decode_tokens: int = 0,
    ) -> None:
        assert role == "prefill" or kv_capacity > 0
        assert block_tokens is None or (role == "prefill" and block_tokens >= 1)
        self.index = index
        self.role = role
        self.chunk_tokens = chunk_tokens
        self.max_num_seqs = max_num_seqs
        self.max_jobs = max_jobs
        self.kv_capacity = kv_capacity
        self.block_tokens = block_tokens
        self.no_decode_tokens = no_decode_tokens
        self.kv_free = kv_capacity
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.sending = 0  # prefill jobs computed whose last write is still on the wire
        self.is_busy = False
        self.last_step_start = float("-inf")
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_decodes = 0  # decode tokens over all steps (mean batch = num_decodes / num_steps)

    # ---- KV reservations (colocated and decode workers) ----

    def can_reserve(self, seq: SimSeq) -> bool:
        return seq.kv_tokens <= self.kv_free

    def reserve(self, seq: SimSeq) -> None:
        assert self.can_reserve(seq)
        self.kv_free -= seq.kv_tokens
        seq.home = self.index

    def release(self, seq: SimSeq) -> None:
        self.kv_free += seq.kv_tokens
        assert self.kv_free <= self.kv_capacity

    # ---- steps ----

    def plan(self, prefill_queue: deque[SimSeq] | None = None) -> list[Work]:
        """The next step's work, admitting from ``waiting`` (or, for prefill, the shared queue)."""
        if self.role == "decode":
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.popleft())
            return [Work(s, 1, False) for s in self.running]
        budget = float("inf") if self.chunk_tokens is None else self.chunk_tokens
        batch: list[Work] = []
        if self.role == "colocated":
            for s in self.running:
                if s.is_prefilled:
                    batch.append(Work(s, 1, False))
                    budget -= 1
            queue, limit = self.waiting, self.max_num_seqs
            if not batch and self.chunk_tokens is not None:
                budget = self._no_decode_budget(self.chunk_tokens)
        else:
            assert prefill_queue is not None
            queue, limit = prefill_queue, self.max_jobs
        for s in self.running:
            if not s.is_prefilled and budget > 0:
                n = self._chunk(s, budget)
                if n:
                    batch.append(Work(s, n, True))
                    budget -= n
        while queue and len(self.running) + self.sending < limit and budget > 0:
            n = self._chunk(queue[0], budget)
            if not n:  # a hand-off chunk needs a whole block of budget
                break
            s = queue.popleft()
            self.running.append(s)
            batch.append(Work(s, n, True))
            budget -= n
        return batch

    def _no_decode_budget(self, budget: int) -> int:
        """A colocated step with no decode in it: the oldest prompt (running, else the next
        waiting) may take up to ``no_decode_tokens``, but no more than it has left (the engine
        scheduler's ``_step_budget``)."""
        if self.no_decode_tokens <= budget:
            return budget
        pending = [s for s in self.running if not s.is_prefilled]
        oldest = pending[0] if pending else self.waiting[0] if self.waiting else None
        if oldest is None:
            return budget
        return max(budget, min(self.no_decode_tokens, oldest.prompt_len - oldest.num_computed))

    def job_sent(self) -> None:
        """A prefill job's last write landed: its slot is free."""
        assert self.role == "prefill" and self.sending > 0
        self.sending -= 1

    def _chunk(self, s: SimSeq, budget: float) -> int:
        """Prompt tokens of ``s`` to compute in a step with ``budget`` tokens left (the
        engine scheduler's ``_chunk_size``)."""
        left = s.prompt_len - s.num_computed
        n = int(min(left, budget))
        bs = self.block_tokens
        if bs is None:
            return n
        if n == left:
            return n - (n % bs or bs) if s.num_computed > 0 and n > bs else n
        return n - n % bs

    def complete(self, batch: list[Work], now: float) -> StepOutcome:
        """Apply a step that ended at ``now``: prompt progress, tokens, finished sequences."""
        prefilled, finished = [], []
        self.num_steps += 1
        for w in batch:
            s = w.seq
            if w.is_prefill:
                s.num_computed += w.num_new
                if not s.is_prefilled:
                    continue
                prefilled.append(s)
                if self.role == "prefill":
                    self.running.remove(s)  # its first token comes once its KV has landed
                    self.sending += 1  # its slot, until then
                    continue
            else:
                self.num_decodes += 1
            s.token_times.append(now)
            if s.is_finished:
                self.running.remove(s)
                self.release(s)
                finished.append(s)
        return StepOutcome(prefilled, finished)
