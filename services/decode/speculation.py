"""Speculative decoding as a step hook of the decode worker (``step_hooks.py``).

Before each step it hands the worker the draft trees that continue their sequence's current
length (``DraftBook.drafts``); after it, it accounts the verification, forgets the finished
sequences and queues the context deltas and DraftForgets that ``take_messages()`` hands the
service to send. A step never waits for a draft: a sequence without a valid one decodes plainly.
As a feature (shared/bus/worker_feature.py) it takes proposals on ``decode_draft(id)`` and
hears of draft workers gone (``REGISTRY_WORKER_GONE``); its outbox is the queued contexts
(``DRAFT_CONTEXT``, or ``draft_context(draft worker)`` once pinned) and DraftForgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.services.decode.drafts import DraftBook, Outgoing
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.step_hooks import Step, StepHook, StepPlan
from kvmesh.shared.bus.messages.drafts import DraftForget, DraftProposal
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.bus.worker_feature import Outbound, Route, Site
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.engine.draft_tree import DraftTree, DraftTreeError
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.decode.compose import DecodeParts

log = logs.get_logger(__name__)


def decoding(engine: LLMEngine) -> dict[str, Sequence]:
    """The sequences decoding now (their KV computed up to the last token), those a draft may
    speed up: choice 0 of a request (its other choices are not drafted), past its first token."""
    return {
        seq.request_id: seq
        for seq in engine.scheduler.running
        if not seq.prefill_only
        and seq.index == 0
        and seq.num_output_tokens >= 1
        and seq.num_uncomputed_tokens == 1
    }


class Speculation(StepHook):
    def __init__(
        self,
        book: DraftBook,
        metrics: DecodeMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.book = book
        self.metrics = metrics
        self._clock = clock
        self._outbox: list[Outgoing | tuple[str, DraftForget]] = []

    @classmethod
    def compose(cls, parts: DecodeParts) -> Speculation | None:
        """``--speculative``: drafts from the draft workers, verified by each step."""
        if not parts.config.speculative:
            return None
        return cls(DraftBook(parts.worker_id), parts.metrics)

    # ---- the engine loop ------------------------------------------------------------------------

    def before_step(self, engine: LLMEngine) -> StepPlan:
        """The proposals that continue their sequence's current length, as trees."""
        limit = engine.max_seq_len
        contexts = {  # a draft past max_tokens or the length limit would be verified for nothing
            rid: (
                seq.token_ids,
                min(seq.params.max_tokens - seq.num_output_tokens, limit - len(seq)) - 1,
            )
            for rid, seq in decoding(engine).items()
        }
        trees = {}
        for rid, (tokens, parents) in self.book.drafts(contexts).items():
            try:
                trees[rid] = DraftTree(tokens, parents)
            except DraftTreeError as exc:  # a message is data: a malformed tree is dropped
                log.debug("ignored malformed draft tree", request_id=rid, error=str(exc))
        return StepPlan(drafts=trees)

    def after_step(self, engine: LLMEngine, step: Step) -> None:
        """Account the verification, forget finished sequences, queue the context deltas."""
        trees = step.drafts
        verified = [out for out in step.outputs if out.request_id in trees]
        if verified:
            positions = sum(trees[out.request_id].depth for out in verified)
            accepted = sum(out.accepted_drafts for out in verified)
            self.metrics.observe_verify(
                step.seconds,
                positions,
                accepted,
                [len(out.new_token_ids) for out in verified],
                num_nodes=sum(len(trees[out.request_id]) for out in verified),
            )
            for out in verified:
                self.book.on_verified(
                    out.request_id, trees[out.request_id].depth, out.accepted_drafts
                )
        for out in step.outputs:
            if out.finished and out.index == 0:
                holder = self.book.forget(out.request_id)
                if holder is not None:
                    self._outbox.append((holder, DraftForget(out.request_id)))
        seqs = {
            rid: (seq.token_ids, seq.num_prompt_tokens) for rid, seq in decoding(engine).items()
        }
        self._outbox += self.book.contexts(seqs, self._clock())

    def on_admitted(self, request_id: str, done: PrefillDone) -> None:
        """A prefill wrote the prompt's draft KV into a draft worker: its contexts go there."""
        if done.draft_worker_id:
            self.book.pin(request_id, done.draft_worker_id, self._clock())

    # ---- what the service hands in and takes out ------------------------------------------------

    def on_proposal(self, proposal: DraftProposal) -> None:
        """Keep a draft proposal for the next steps; its latency goes to the metrics."""
        latency = self.book.on_proposal(proposal, self._clock())
        if latency is not None:
            self.metrics.spec_draft_latency_seconds.observe(latency)

    def on_worker_gone(self, draft_worker_id: str) -> None:
        self.book.on_worker_gone(draft_worker_id)

    async def _on_proposal(self, proposal: DraftProposal) -> None:
        self.on_proposal(proposal)

    async def _on_gone(self, gone: WorkerGone) -> None:
        if gone.role == "draft":
            self.on_worker_gone(gone.worker_id)

    def routes(self, site: Site) -> tuple[Route, ...]:
        subjects = site.subjects
        return (
            (subjects.decode_draft(site.worker_id), DraftProposal, self._on_proposal),
            (subjects.REGISTRY_WORKER_GONE, WorkerGone, self._on_gone),
        )

    def outbox(self, subjects: Subjects) -> list[Outbound]:
        """What the last steps queued, addressed: contexts to the queue group or their pinned
        draft worker, DraftForgets to the worker that holds the sequence."""
        out: list[Outbound] = []
        for item in self.take_messages():
            if isinstance(item, Outgoing):
                worker = item.draft_worker_id
                subject = (
                    subjects.DRAFT_CONTEXT if worker is None else subjects.draft_context(worker)
                )
                out.append((subject, item.message))
            else:
                holder, forget = item
                out.append((subjects.draft_forget(holder), forget))
        return out

    def take_messages(self) -> list[Outgoing | tuple[str, DraftForget]]:
        """The draft messages the last steps queued: contexts (``Outgoing``) and
        ``(draft worker id, DraftForget)``; the service sends them."""
        out, self._outbox = self._outbox, []
        return out
