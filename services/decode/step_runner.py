"""One engine step of a decode worker: its hooks around it, its metrics, its token events.

The step runs in a worker thread while the engine lock is held (torch releases the GIL), so the
event loop keeps serving NATS and the data plane meanwhile. Hooks (``step_hooks.py``) plan it
(drafts to verify) and see what it did, in their order; a local prefill's first token carries
its wait and prefill time (``first_token.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec
from kvmesh.services.decode.events import token_event
from kvmesh.services.decode.first_token import FirstTokenClock
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestOutput


class StepRunner:
    def __init__(
        self,
        engine: LLMEngine,
        lock: asyncio.Lock,
        hooks: Sequence[StepHook],
        metrics: DecodeMetrics,
        first_token: FirstTokenClock,
    ) -> None:
        self.engine = engine
        self._lock = lock
        self.hooks = hooks
        self.metrics = metrics
        self.first_token = first_token

    async def step(self) -> list[TokenEvent]:
        """One engine step (in a worker thread, holding the lock); returns its token events."""
        engine = self.engine
        async with self._lock:
            if not engine.has_unfinished():
                return []
            trees: dict[str, DraftTree] = {}
            for hook in self.hooks:
                plan = hook.before_step(engine)
                if plan is not None:
                    trees.update(plan.drafts)
            # a finished sequence is gone after the step; only hooks look at it then
            before = dict(engine.seqs) if self.hooks else {}
            step_started = time.monotonic()
            outputs = await asyncio.to_thread(engine.step, trees or None)
            step_ended = time.monotonic()
            seconds = step_ended - step_started
            if len(self.first_token):
                self._time_first_tokens(outputs, step_started, step_ended)
            self.metrics.observe_step(
                seconds,
                batch_size=sum(1 for out in outputs if out.new_token_ids),
                num_tokens=sum(len(out.new_token_ids) for out in outputs),
                num_preemptions=engine.scheduler.num_preemptions,
            )
            bm = engine.block_manager
            self.metrics.observe_prefix_cache(bm.num_hit_tokens, len(bm.hash_to_block))
            step = Step(outputs, trees, seconds, before)
            for hook in self.hooks:
                hook.after_step(engine, step)
        return [event for out in outputs if (event := self._event(out)) is not None]

    def _time_first_tokens(
        self, outputs: list[RequestOutput], started_at: float, ended_at: float
    ) -> None:
        seqs = self.engine.seqs
        self.first_token.after_step(
            started_at,
            ended_at,
            lambda rid: seq.num_computed_tokens if (seq := seqs.get(rid)) is not None else None,
            (out.request_id for out in outputs if out.new_token_ids),
        )

    def _event(self, out: RequestOutput) -> TokenEvent | None:
        """``token_event`` with the decode worker's first-token times on a first event."""
        event = token_event(out)
        if event is not None and len(self.first_token):
            wait_s, prefill_s = self.first_token.take(out.request_id)
            if out.finished:
                self.first_token.forget(out.request_id)
            if wait_s or prefill_s:
                event = msgspec.structs.replace(event, wait_s=wait_s, prefill_s=prefill_s)
        return event
