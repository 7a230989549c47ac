"""DraftCore: what a draft worker knows of the sequences it drafts for (pure, no I/O).

Each sequence's context (prompt + output) arrives once whole and then as deltas from a start
position (``DraftContext``). A delta that does not continue what the core holds (a sequence it
never saw, one it dropped, or a gap) is answered with ``need_context``: the decode worker then
sends the whole context again. The core keeps at most ``max_sequences`` contexts and drops the
least recently updated first. ``take_jobs`` hands out the sequences whose context changed since
their last draft; ``proposal`` turns a drafted tree into the message, unless the context grew
past it meanwhile (it is drafted again from the new context anyway).

Pipelined chains (``pipeline_depth`` > 0, the model drafters, whose tokens cost a forward pass
each): a proposal drafts ``pipeline_depth`` tokens, past the K the decode worker verifies next,
for the most likely outcome of that step (every draft accepted, then the drafter's own next
tokens). The core keeps the part of the chain past the sequence's tokens (``ahead``) while the
deltas that arrive follow it: the next draft starts from context + ahead and only tops the chain
up to ``pipeline_depth`` (K + 1 new tokens after a step that accepted everything). A delta that
leaves the chain discards it (a miss).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.bus.messages.drafts import DraftContext, DraftProposal
from kvmesh.shared.bus.recent_ids import RecentIds


@dataclass(slots=True)
class DraftSequence:
    request_id: str
    decode_worker_id: str
    tokens: list[int]
    num_prompt_tokens: int
    is_dirty: bool = True  # the context changed since the last draft
    ahead: list[int] = field(default_factory=list)  # drafted chain past tokens, still followed
    touched_at: float = 0.0  # when its last context arrived (the caller's clock)


@dataclass(frozen=True, slots=True)
class DraftSnapshot:
    """One sequence to draft for: its whole context now (``position`` tokens), and the drafts
    past it that are kept (``ahead``): the drafter continues context + ahead."""

    request_id: str
    decode_worker_id: str
    context: tuple[int, ...]
    num_prompt_tokens: int
    ahead: tuple[int, ...] = ()

    @property
    def position(self) -> int:
        return len(self.context)


class DraftCore:
    def __init__(
        self, worker_id: str, max_sequences: int, depth: int = 0, pipeline_depth: int = 0
    ) -> None:
        assert max_sequences >= 1, max_sequences
        assert pipeline_depth == 0 or pipeline_depth >= depth, (pipeline_depth, depth)
        self.worker_id = worker_id
        self.depth = depth  # DraftProposal.depth: how deep the decode worker verifies
        self.pipeline_depth = pipeline_depth  # 0: every change drafted anew (trees, ngram)
        self.max_sequences = max_sequences
        self.seqs: OrderedDict[str, DraftSequence] = OrderedDict()
        self.num_verified = 0  # draft tokens on paths decode workers verified
        self.num_accepted = 0  # ... of which they accepted
        self.num_proposals = 0
        self.num_resyncs = 0  # need_context answers
        self.num_evicted = 0
        self.num_idle_dropped = 0  # dropped by drop_idle
        # Sequences that ended (finished, aborted, their decode worker died): a context still on
        # its way for one is dropped, not held until the LRU bound evicts it. Bounded by count
        # (an id ends once: retries and migrations get new ones), so no clock.
        self.ended = RecentIds(ttl_s=math.inf, max_ids=4 * max_sequences)

    def on_context(self, msg: DraftContext, now: float = 0.0) -> DraftProposal | None:
        """Take a context (whole or delta) that arrived at ``now``. Returns a ``need_context``
        answer when the delta does not continue what is held."""
        self.num_verified += msg.num_verified
        self.num_accepted += msg.num_accepted
        if msg.request_id in self.ended:
            return None
        seq = self.seqs.get(msg.request_id)
        if msg.start == 0:
            seq = DraftSequence(
                msg.request_id, msg.decode_worker_id, list(msg.token_ids), msg.num_prompt_tokens
            )
            self.seqs[msg.request_id] = seq
        elif seq is None or msg.start > len(seq.tokens):
            if seq is not None:
                del self.seqs[msg.request_id]  # to be sent again whole: it has not ended
            self.num_resyncs += 1
            return DraftProposal(
                msg.request_id,
                self.worker_id,
                position=msg.start + len(msg.token_ids),
                need_context=True,
            )
        else:  # continues (or rewrites the tail of) what is held
            follows = msg.start == len(seq.tokens)
            follows = follows and seq.ahead[: len(msg.token_ids)] == list(msg.token_ids)
            seq.ahead = seq.ahead[len(msg.token_ids) :] if follows else []
            del seq.tokens[msg.start :]
            seq.tokens += msg.token_ids
            seq.decode_worker_id = msg.decode_worker_id
        seq.is_dirty = bool(seq.tokens) and (
            not self.pipeline_depth or len(seq.ahead) < self.pipeline_depth
        )
        seq.touched_at = now
        self.seqs.move_to_end(msg.request_id)
        while len(self.seqs) > self.max_sequences:
            self.seqs.popitem(last=False)
            self.num_evicted += 1
        return None

    def forget(self, request_id: str) -> bool:
        """The sequence ended (its DraftForget, its Abort): drop it, and any context that comes
        for it later. True if it was held."""
        self.ended.add(request_id, 0.0)
        return self.seqs.pop(request_id, None) is not None

    def forget_worker(self, decode_worker_id: str) -> int:
        """A decode worker died: its sequences ended with it (a migrated stream comes back under
        a new id). Returns how many were dropped."""
        gone = [rid for rid, seq in self.seqs.items() if seq.decode_worker_id == decode_worker_id]
        for rid in gone:
            self.forget(rid)
        return len(gone)

    def drop_idle(self, now: float, idle_s: float) -> int:
        """Drop the sequences no context reached for ``idle_s`` (their end was lost: a
        DraftForget published while this worker was cut off from NATS). Not marked ended: a
        sequence that was only paused (preempted) is answered ``need_context`` at its next delta
        and sent again whole. Returns how many were dropped."""
        dropped = 0
        while self.seqs:
            rid, seq = next(iter(self.seqs.items()))  # least recently updated first
            if now - seq.touched_at < idle_s:
                break
            del self.seqs[rid]
            dropped += 1
        self.num_idle_dropped += dropped
        return dropped

    @property
    def has_jobs(self) -> bool:
        return any(seq.is_dirty for seq in self.seqs.values())

    def take_jobs(self, max_batch: int) -> list[DraftSnapshot]:
        """Up to ``max_batch`` sequences whose context changed, least recently updated first;
        they count as drafted from now on."""
        jobs = []
        for seq in self.seqs.values():
            if len(jobs) == max_batch:
                break
            if seq.is_dirty:
                seq.is_dirty = False
                jobs.append(
                    DraftSnapshot(
                        seq.request_id,
                        seq.decode_worker_id,
                        tuple(seq.tokens),
                        seq.num_prompt_tokens,
                        tuple(seq.ahead),
                    )
                )
        return jobs

    def proposal(
        self, job: DraftSnapshot, tokens: tuple[int, ...], parents: tuple[int, ...]
    ) -> DraftProposal | None:
        """The message for a drafted tree that continues the job's context + ahead (an empty
        one too: it tells the decode worker this worker is alive and holds the context). A tree
        drafted from a context that has grown since is still sent while the growth is no longer
        than the tree: the decode worker uses the subtree below the new tokens if they lie on
        one of its paths. None when the sequence was forgotten, or grew past the tree."""
        assert len(tokens) == len(parents), (tokens, parents)
        if job.ahead:  # a chain topped up: the kept drafts, then the new ones
            assert all(p == i - 1 for i, p in enumerate(parents)), parents
            tokens = job.ahead + tokens
            parents = tuple(range(-1, len(tokens) - 1))
        seq = self.seqs.get(job.request_id)
        if seq is None or len(seq.tokens) - job.position > len(tokens):
            return None
        if self.pipeline_depth:  # keep what lies past the tokens the sequence has now
            grown = seq.tokens[job.position :]
            follows = list(tokens[: len(grown)]) == grown
            seq.ahead = list(tokens[len(grown) :]) if follows else []
        self.num_proposals += 1
        return DraftProposal(
            job.request_id, self.worker_id, job.position, tokens, parents, depth=self.depth
        )

    def stats(self) -> dict[str, Any]:
        """Acceptance figures (as the decode workers reported them) and the load."""
        return {
            "sequences": len(self.seqs),
            "proposals": self.num_proposals,
            "verified_tokens": self.num_verified,
            "accepted_tokens": self.num_accepted,
            "acceptance": round(self.num_accepted / self.num_verified, 4)
            if self.num_verified
            else None,
            "resyncs": self.num_resyncs,
            "evicted": self.num_evicted,
            "idle_dropped": self.num_idle_dropped,
        }
