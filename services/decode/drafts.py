"""DraftBook: the decode worker's side of speculative decoding (pure, no I/O, clock passed in).

For each decoding sequence it knows which draft worker holds its context (pinned by that
worker's first proposal), how many of its tokens that worker has, the latest proposal, and what
to report back about the last verification. After each step, ``contexts()`` says what to send:
a whole context to the queue group while no worker is pinned (any may take it), the appended
tokens to the pinned worker otherwise; a sequence whose prompt's draft KV a prefill wrote into
a draft worker is pinned to it from the start (``pin``), so its whole first context goes there.
Before each step, ``drafts()`` hands out the proposals that continue the sequence as it is
now: one drafted at its current length as it is, one drafted a few tokens earlier by the
subtree below the tokens added since, when they lie on one of its paths (``rebase_tree``;
otherwise it is stale), cut to the proposal's depth and to the tokens the sequence may still
emit.

Pipelining: a proposal is kept after it is handed out, until the sequence leaves it (a draft
rejected, or a token past its deepest node). Draft workers draft beyond K (lookahead: for the
most likely outcome of the verify step, every draft accepted and the drafter's own guess of the
next token), so when every draft was accepted the same proposal still holds the drafts of the
next step, and the step after it never waits for the answer to the context just sent. A pinned
worker that stays silent for ``unpin_after_s``, or that asks for the context again, is let go:
the context goes to the queue group again. Nothing here ever waits for a draft.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.shared.bus.messages.drafts import DraftContext, DraftProposal

Tree = tuple[tuple[int, ...], tuple[int, ...]]  # (tokens, parents)


def rebase_tree(
    tokens: Sequence[int], parents: Sequence[int], appended: Sequence[int], max_depth: int = 0
) -> Tree | None:
    """The part of a draft tree that still applies after ``appended`` tokens were added to its
    sequence: the subtree below the path that spells them, re-rooted, down to ``max_depth``
    (0: all of it). None when they leave the tree (the proposal is stale). Nodes keep their
    order, so parents still come before their children."""
    if len(tokens) != len(parents):
        return None
    root = -1
    for token in appended:
        root = next((i for i, p in enumerate(parents) if p == root and tokens[i] == token), None)
        if root is None:
            return None
    index: dict[int, int] = {root: -1}  # old node -> new index (the new root: -1)
    depth: dict[int, int] = {root: 0}
    new_tokens: list[int] = []
    new_parents: list[int] = []
    for i in range(root + 1, len(tokens)):
        parent = parents[i]
        if parent not in index or not -1 <= parent < i:
            continue
        d = depth[parent] + 1
        if max_depth and d > max_depth:
            continue
        index[i], depth[i] = len(new_tokens), d
        new_tokens.append(tokens[i])
        new_parents.append(index[parent])
    return tuple(new_tokens), tuple(new_parents)


@dataclass(slots=True)
class _Link:
    draft_worker_id: str | None = None  # the worker holding the context; None: not pinned
    num_sent: int = 0  # tokens that worker holds (0: send the whole context)
    proposal: DraftProposal | None = None  # the latest one (valid while its position matches)
    heard_at: float = 0.0  # last proposal (or pinning) from the pinned worker
    sent_at: tuple[int, float] = (0, 0.0)  # (length it brought the context to, when)
    num_verified: int = 0  # to report with the next context
    num_accepted: int = 0


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A context message and where it goes: the pinned draft worker, or (None) the queue
    group."""

    draft_worker_id: str | None
    message: DraftContext


class DraftBook:
    def __init__(self, worker_id: str, unpin_after_s: float = 2.0) -> None:
        self.worker_id = worker_id
        self.unpin_after_s = unpin_after_s
        self.links: dict[str, _Link] = {}

    def on_proposal(self, proposal: DraftProposal, now: float) -> float | None:
        """Keep a proposal (the latest per sequence). Returns the draft latency (context sent ->
        this proposal) when it answers the latest context, else None."""
        link = self.links.get(proposal.request_id)
        if link is None:  # finished, or never ours
            return None
        if proposal.need_context:
            if proposal.draft_worker_id == link.draft_worker_id or link.draft_worker_id is None:
                link.draft_worker_id, link.num_sent, link.proposal = None, 0, None
            return None
        if link.draft_worker_id is None:
            link.draft_worker_id = proposal.draft_worker_id
        if proposal.draft_worker_id == link.draft_worker_id:
            link.heard_at = now
        link.proposal = proposal
        position, sent = link.sent_at
        return now - sent if proposal.position == position else None

    def drafts(self, seqs: Mapping[str, tuple[Sequence[int], int]]) -> dict[str, Tree]:
        """``(tokens, parents)`` per sequence whose latest proposal still continues it
        (``seqs``: request id -> (its tokens now, the most drafts worth verifying: the tokens
        it may still emit less one)). A proposal stays for the next steps until the sequence
        leaves it (stale) or passes its deepest node (used up); then it is dropped."""
        out = {}
        for rid, (tokens, room) in seqs.items():
            link = self.links.get(rid)
            if link is None or link.proposal is None:
                continue
            p = link.proposal
            if p.position > len(tokens):
                link.proposal = None
                continue
            tree = rebase_tree(p.tokens, p.parents, tokens[p.position :], p.depth)
            if tree is None or not tree[0]:
                link.proposal = None
                continue
            if room >= 1:
                cut = rebase_tree(*tree, (), room)  # the root's children stay: never empty
                assert cut is not None and cut[0], (tree, room)
                out[rid] = cut
        return out

    def on_verified(self, request_id: str, num_positions: int, num_accepted: int) -> None:
        """A proposal of ``num_positions`` depth was verified; ``num_accepted`` drafts kept."""
        link = self.links.get(request_id)
        if link is not None:
            link.num_verified += num_positions
            link.num_accepted += num_accepted

    def contexts(self, seqs: Mapping[str, tuple[Sequence[int], int]], now: float) -> list[Outgoing]:
        """What to send after a step. ``seqs``: request id -> (its tokens, prompt length) for
        every sequence decoding now."""
        out = []
        for rid, (tokens, num_prompt) in seqs.items():
            link = self.links.setdefault(rid, _Link())
            if link.draft_worker_id is not None and now - link.heard_at > self.unpin_after_s:
                link.draft_worker_id, link.num_sent = None, 0  # silent: dead, slow or restarted
            if len(tokens) <= link.num_sent:
                continue
            start = link.num_sent if link.draft_worker_id is not None else 0
            message = DraftContext(
                rid,
                self.worker_id,
                start,
                tuple(tokens[start:]),
                num_prompt_tokens=num_prompt,
                num_verified=link.num_verified,
                num_accepted=link.num_accepted,
            )
            link.num_verified = link.num_accepted = 0
            link.num_sent = len(tokens)
            link.sent_at = (len(tokens), now)
            if link.draft_worker_id is None:
                link.heard_at = now  # the unpin clock starts when a worker gets pinned
            out.append(Outgoing(link.draft_worker_id, message))
        return out

    def pin(self, request_id: str, draft_worker_id: str, now: float) -> None:
        """A new sequence whose prompt KV ``draft_worker_id`` already holds (the prefill wrote
        it there): its first context goes to that worker, not the queue group. A pinned
        worker's silence lets it go as ever."""
        self.links[request_id] = _Link(draft_worker_id, heard_at=now)

    def forget(self, request_id: str) -> str | None:
        """The sequence finished or was aborted: returns the draft worker to tell, if any."""
        link = self.links.pop(request_id, None)
        return link.draft_worker_id if link is not None else None

    def on_worker_gone(self, draft_worker_id: str) -> None:
        """A draft worker died: its sequences go to the queue group again."""
        for link in self.links.values():
            if link.draft_worker_id == draft_worker_id:
                link.draft_worker_id, link.num_sent, link.proposal = None, 0, None
