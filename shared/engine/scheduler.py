"""Continuous batching with chunked prefill under a per-step token budget.

Each step serves running sequences first (decodes take one token, unfinished prefills take a chunk
of what is left of the budget), then admits waiting sequences while the budget, ``max_num_seqs``
and free blocks allow. When a running sequence needs a block and none is free, the most recently
admitted sequence is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed later. ``prefill_only`` sequences never need a block after admission and are never
chosen for preemption, so the chunks they already handed off stay valid.

With ``reserve_output_tokens`` > 0 a sequence is admitted only while the free blocks also cover
the output room (up to that many tokens, at most its ``max_tokens``) still owed to every sequence
holding blocks, so under load requests wait in the queue instead of being admitted and preempted.

Prefill is first come, first served: running prefills take chunks in the order they were admitted,
so the oldest prompt gets all of the budget left by the decodes until it is done, and a later one
only what remains (a short prompt may ride along in that remainder). A prompt's first token
therefore waits for the prompts before it, never for those after it.

The budget bounds how long a step stalls the streams decoding in it. A step with no decode in it
(nothing running decodes, no prefilled sequence waits to) stalls no stream, so with
``max_num_batched_tokens_no_decode`` above the budget the oldest prompt takes up to that many
tokens (no more than it has left): fewer, larger chunks, less per-step cost before its first token.

An owner that swaps preempted sequences out (a decode worker with a kv-store) reads ``preempted``
after each step and may ``hold`` a waiting sequence while its KV is read back: admission, which
goes in queue order, stops at a held sequence until ``unhold``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(eq=False)
class Scheduler:
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    reserve_output_tokens: int = 0
    # budget of a step without decodes (0: max_num_batched_tokens always)
    max_num_batched_tokens_no_decode: int = 0
    waiting: deque[Sequence] = field(default_factory=deque, init=False)
    running: list[Sequence] = field(default_factory=list, init=False)
    num_preemptions: int = field(default=0, init=False)
    # preempted by the last schedule(), in order
    preempted: list[Sequence] = field(default_factory=list, init=False)
    # request ids kept from admission (hold)
    _held: set[str] = field(default_factory=set, init=False)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (KV written elsewhere) waits at the front of
        the queue for a place in the running batch, then decodes."""
        assert seq.block_table and seq.num_uncomputed_tokens == 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def hold(self, seq: Sequence) -> None:
        """Keep a waiting sequence (and those queued behind it) from admission until ``unhold``."""
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self._held.add(seq.request_id)

    def unhold(self, request_id: str) -> None:
        self._held.discard(request_id)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def fits(self, seq: Sequence) -> bool:
        """Whether a waiting sequence without blocks, at the head of the queue, would be admitted
        by the next ``schedule()`` as things stand (a seat, its blocks, everyone's output room;
        holds aside): what a holder waits for before reading its KV back."""
        bm = self.block_manager
        num_new = bm.num_blocks_for(len(seq))
        return (
            len(self.running) < self.max_num_seqs
            and bm.can_allocate(seq)
            and self._has_room(seq, num_new, self.num_promised_blocks())
        )

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); frees nothing."""
        self._held.discard(seq.request_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def output_room(self, num_tokens: int, max_tokens: int, num_held_blocks: int) -> int:
        """Blocks a sequence of ``num_tokens`` (prompt) holding ``num_held_blocks`` may still
        take for its reserved output room."""
        if not self.reserve_output_tokens:
            return 0
        final = num_tokens + min(max_tokens, self.reserve_output_tokens)
        return max(0, self.block_manager.num_blocks_for(final) - num_held_blocks)

    def _owed(self, seq: Sequence) -> int:
        """Output room owed to ``seq`` now: only a sequence that holds blocks is owed any."""
        if not seq.block_table or seq.prefill_only:
            return 0
        return self.output_room(seq.num_prompt_tokens, seq.params.max_tokens, len(seq.block_table))

    def num_promised_blocks(self) -> int:
        """Output room owed to sequences that hold blocks (running, or prefilled and waiting)."""
        if not self.reserve_output_tokens:
            return 0
        return sum(self._owed(s) for s in (*self.running, *self.waiting))

    def _has_room(self, seq: Sequence, num_new_blocks: int, promised: int) -> bool:
        """Whether admitting ``seq`` (taking ``num_new_blocks`` now) leaves everyone's room;
        ``promised``: ``num_promised_blocks()``, which counts ``seq`` too if it holds blocks."""
        if not self.reserve_output_tokens or seq.prefill_only:
            return True
        held = len(seq.block_table) + num_new_blocks
        own = self.output_room(seq.num_prompt_tokens, seq.params.max_tokens, held)
        others = promised - self._owed(seq)
        return num_new_blocks + own + others <= self.block_manager.num_free_blocks

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if not seq.prefill_only:
            return n
        bs = self.block_manager.block_size
        if n == seq.num_uncomputed_tokens:
            if seq.num_computed_tokens > 0 and n > bs:
                # The last hand-off chunk's write overlaps no compute: cut the final chunk to at
                # most one block, so only one block's transfer is exposed, not a chunk's.
                return n - (n % bs or bs)
            return n
        # Hand-off chunks are whole blocks; only the last one may be partial.
        return n - n % bs

    def _step_budget(self, decodes: list[Sequence], prefills: list[Sequence]) -> int:
        """Tokens this step may compute. With no stream decoding in it (none running decodes, no
        prefilled sequence is waiting to) and no hand-off prefill, the oldest prompt may take up
        to the no-decode budget, but no more than it has left: a later prompt riding along would
        delay the oldest one's first token."""
        if self.max_num_batched_tokens_no_decode <= self.max_num_batched_tokens or decodes:
            return self.max_num_batched_tokens
        seqs = (*self.running, *self.waiting)
        if any(s.prefill_only for s in seqs) or any(s.block_table for s in self.waiting):
            return self.max_num_batched_tokens
        oldest = prefills[0] if prefills else self.waiting[0] if self.waiting else None
        if oldest is None:
            return self.max_num_batched_tokens
        left = len(oldest) - oldest.num_computed_tokens
        return max(self.max_num_batched_tokens, min(self.max_num_batched_tokens_no_decode, left))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq)

    def _pick_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """The latest-admitted running sequence not yet scheduled this step that may be
        preempted to make room for ``seq``."""
        for victim in reversed(self.running):
            if victim is not seq and not victim.prefill_only and id(victim) not in scheduled:
                return victim
        return None

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch([], [])
        preempted = False
        self.preempted = []
        # Decodes first, so a long prefill never starves them; then prefill chunks.
        decodes, prefills = [], []
        for seq in self.running:
            (decodes if len(seq.token_ids) - seq.num_computed_tokens == 1 else prefills).append(seq)
        budget = self._step_budget(decodes, prefills)
        for seq in decodes + prefills if prefills else decodes:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an earlier one
                continue
            n = self._chunk_size(seq, budget)
            if n == 0:
                continue
            need = bm.num_blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if need > bm.num_free_blocks:
                assert not seq.prefill_only, "prefill_only sequences hold all their blocks"
                preempted = True
                scheduled = {id(s) for s in batch.seqs}
                while need > bm.num_free_blocks:
                    victim = self._pick_victim(seq, scheduled)
                    if victim is None:
                        break
                    self._preempt(victim)
                if need > bm.num_free_blocks:
                    self._preempt(seq)
                    continue
            if need > 0:
                bm.append_slots(seq, n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        if preempted:
            return batch
        # Counted once per step, then kept current as each admission changes what is owed.
        promised = self.num_promised_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_id in self._held:
                break
            owed_before = self._owed(seq)
            if seq.block_table:  # admitted with its prompt KV written elsewhere
                n = 1
                if not bm.can_append(seq, n) or not self._has_room(seq, 0, promised):
                    break
            else:
                num_new = bm.num_blocks_for(len(seq))
                if not bm.can_allocate(seq) or not self._has_room(seq, num_new, promised):
                    break
                bm.allocate(seq)
                n = self._chunk_size(seq, budget)
                if n == 0:  # a hand-off chunk needs a whole block of budget
                    bm.deallocate(seq)
                    break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            bm.append_slots(seq, n)
            if self.reserve_output_tokens:
                promised += self._owed(seq) - owed_before
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
