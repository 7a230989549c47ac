"""The decode worker: one LLMEngine, the requests it holds, and the engine loop that runs them.

The engine is touched only under ``self._lock`` (a step: ``step_runner.py``). Requests enter three ways: local prefill (``add_request``), a reservation admitted
after its remote prefill (``admit_prefilled``, ``remote_prefills.py``), or not at all (refused).
Every request accepted has one entry in the request table (``request_table.py``) from then to
its end: where it is (reading, queued, reserved, settled, running, aborting), the router that
streams it and its timers; abort, a gone router, a cancelled lease and completion are
transitions of that entry. Blocks leave on finish, abort, failed prefill and lease expiry; each
of these paths ends in exactly one final TokenEvent.

The worker knows no NATS. The service (the shell) drives it: it hands in what arrives (reserve,
writes landed, PrefillDone, Abort, renewals), runs the engine loop (``wait_for_work()``, then
``admit()`` and ``step()`` while there is work) and publishes the TokenEvents these return, and the
Aborts ``expire_leases()`` returns.

Features join the loop as step hooks (``step_hooks.py``), composed by the service from its
config: speculative decoding (``speculation.py``), kv-store puts of finished requests
(``store_puts.py``) and swaps of preempted ones (``swaps.py``). The worker calls them at fixed
points, holding its lock, and knows none of them. Local prefills that read their prefix from a
kv-store first (``reads``, a feature the composition hands in: ``local_reads.py``) are part of
how requests enter, not a step hook. A request with a
structured output waits, accepted, until its grammar is compiled (``grammar_gate.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from kvmesh.services.decode.events import failed_event
from kvmesh.services.decode.first_token import FirstTokenClock
from kvmesh.services.decode.grammar_gate import GrammarGate
from kvmesh.services.decode.load import measure
from kvmesh.services.decode.local_reads import LocalPrefixReads
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.remote_prefills import RemotePrefills
from kvmesh.services.decode.request_table import RequestEntry, RequestPhase, RequestTable
from kvmesh.services.decode.step_hooks import StepHook
from kvmesh.services.decode.step_runner import StepRunner
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.shared.bus.messages.placement import ReserveReply, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import Abort, TokenEvent
from kvmesh.shared.bus.messages.workers import BlockPool, WorkerGone, WorkerLoad
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError
from kvmesh.shared.obs import logs
from kvmesh.shared.text.structured_output import StructuredOutputError
from kvmesh.shared.transport.completions import Completion

log = logs.get_logger(__name__)
T = TypeVar("T")


class DecodeWorker:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        worker_id: str,
        base_addr: int,
        colocated: bool = False,
        windows: LeaseWindows | None = None,
        quarantine_s: float = 30.0,
        metrics: DecodeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        hooks: Iterable[StepHook] = (),
        lock: asyncio.Lock | None = None,
        reads: LocalPrefixReads | None = None,
        wake: asyncio.Event | None = None,
        grammar_compile_timeout_s: float = 10.0,
        resume_window_s: float = 0.0,
    ) -> None:
        """``hooks``: the features of the engine loop, called in this order; ``lock``: the
        engine lock, when the shell gave it to hooks whose background work touches the pool
        (else the worker makes its own); ``reads``: local prefills' prefix reads from a
        kv-store, which set ``wake``, the engine loop's event (composed: given to both);
        ``grammar_compile_timeout_s``: the longest a
        structured output's grammar may take to compile; ``resume_window_s``: how long a
        streaming sequence of a gone router waits for another router to take it over
        (``hand_over``) before it is aborted."""
        self.engine = engine
        self.metrics = metrics or DecodeMetrics()
        self.worker_id = worker_id
        self.base_addr = base_addr  # the receiving region's address: blocks at base + id * bytes
        self.block_bytes = engine.kv_pool.spec.block_bytes
        self.colocated = colocated
        self.is_draining = False
        self._clock = clock
        self._lock = lock or asyncio.Lock()
        self.hooks = tuple(hooks)
        self._wake = wake or asyncio.Event()  # the loop's: shared with ``reads`` when composed
        self.requests = RequestTable()
        self.remote = RemotePrefills(
            engine,
            self.requests,
            self._wake.set,
            worker_id=worker_id,
            base_addr=base_addr,
            windows=windows,
            quarantine_s=quarantine_s,
            hooks=self.hooks,
        )
        self.pending = self.remote.pending
        self.first_token = FirstTokenClock()  # local prefills' wait and prefill time
        self.runner = StepRunner(engine, self._lock, self.hooks, self.metrics, self.first_token)
        self.grammar = GrammarGate(engine.grammars, grammar_compile_timeout_s, self._wake.set)
        # None: local prefills use this worker's own prefix cache only, never a kv-store's
        self.reads = reads  # a feature (local_reads.py): it sets ``wake`` when a read ended
        # streaming sequences of a gone router wait this long for another router to take them
        # over (a client resumes the stream there: docs/faults.md) before they are aborted
        self.resume_window_s = resume_window_s

    # ---- the engine loop (the service drives it) --------------------------------------------

    async def wait_for_work(self) -> None:
        """Return once there is something for ``admit()`` or ``step()`` to do."""
        await self._wake.wait()
        self._wake.clear()

    @property
    def has_unfinished(self) -> bool:
        """The engine holds requests that need more steps."""
        return self.engine.has_unfinished()

    @property
    def is_idle(self) -> bool:
        """Nothing to admit, abort or step: the engine loop would wait for work."""
        return not (
            self.requests.needs_admit
            or (self.reads is not None and (len(self.reads) or self.reads.has_unused))
            or self.has_unfinished
        )

    async def admit(self) -> list[TokenEvent]:
        """Between steps: add the queued local-prefill requests to the engine, admit (or fail)
        the reservations whose lease has a verdict, give back blocks nobody holds, take the
        aborts to the engine. Returns the events to publish before the next step: admitted
        requests' first tokens, failures."""
        events: list[TokenEvent] = []
        async with self._lock:
            if self.reads is not None:
                self.reads.adopt_unused()
                for rid, _, _ in self.reads.take_ended():  # queued now, added below
                    self.requests.read_ended(rid)
            for entry in self.requests.in_phase(RequestPhase.QUEUED):
                events += self._add_local(entry)
            for verdict in self.requests.take_releases():
                events += self.remote.apply(verdict)
            for entry in self.requests.in_phase(RequestPhase.SETTLED):
                assert entry.verdict is not None
                if self.grammar.settled(entry.verdict):  # else admitted once it is compiled
                    events += self.remote.apply(entry.verdict, entry.settled_at)
            for request_id in self.requests.take_aborting():
                if not self.engine.abort(request_id):  # else its "abort" output comes next step
                    self.requests.end(request_id)  # nothing of it in the engine
            work = [w for hook in self.hooks if (w := hook.between_steps(self.engine))]
        for coroutine in work:  # e.g. a swap-in's read, before the step that readmits it
            await coroutine  # (the lock released: a hook's work takes it where it must)
        return self._ended(events)

    def _add_local(self, entry: RequestEntry) -> list[TokenEvent]:
        """A queued local prefill into the engine, once its grammar is in (its failure if it
        cannot be); under the lock."""
        rid, prompt, params = entry.request_id, list(entry.prompt), entry.params
        assert params is not None
        error = ""
        try:
            if not self.grammar.ready(params):
                return []  # next time
        except StructuredOutputError as exc:
            if self.reads is not None:  # what was read stays cached
                self.reads.adopt_for(rid)
            error = f"request {rid!r}: {exc}"
        if not error:
            if self.reads is not None:  # adopted and added at once
                self.metrics.store_hit_tokens.inc(self.reads.adopt_for(rid))
            self.metrics.local_prompt_tokens.inc(len(prompt))
            try:
                self.engine.add_request(rid, prompt, params)
            except RequestError as exc:
                error = str(exc)
            else:
                self.requests.started(rid)
                return []
        self.first_token.forget(rid)
        self.requests.end(rid)
        return [failed_event(rid, len(prompt), error)]

    def close(self) -> None:
        """Stop the grammar compile threads (a compile in flight ends on its own)."""
        self.grammar.close()

    async def step(self) -> list[TokenEvent]:
        """One engine step (in a worker thread, holding the lock); returns its token events."""
        return self._ended(await self.runner.step())

    def _ended(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """``events``, the requests whose final event is among them gone from the table."""
        for event in events:
            if event.finish_reason is not None:
                self.requests.end(event.request_id)
        return events

    async def between_steps(self, work: Callable[[], T]) -> T:
        """``work()``'s result, run between steps (no step runs meanwhile), e.g. a digest of the
        prefix cache; ``work`` must not block."""
        async with self._lock:
            return work()

    # ---- requests in ------------------------------------------------------------------------

    async def reserve(self, req: ReserveRequest) -> ReserveReply:
        """Local prefill: queue the request. Remote prefill: reserve its blocks under a lease."""
        refuse = lambda error: ReserveReply(False, self.worker_id, error=error)
        if self.is_draining:
            return refuse(f"decode worker {self.worker_id} is draining")
        params = req.sampling  # checked when the message was decoded
        rid, prompt = req.request_id, req.prompt_ids
        error = self.requests.refusal(rid, req.lease_id, self._clock())
        if error:
            return refuse(error)
        already = f"request {rid!r} is already on decode worker {self.worker_id}"
        if rid in self.requests or rid in self.pending:
            return refuse(already)
        if req.local_prefill or self.colocated:
            # Accepted now, queued by the engine after the step in flight: the reply never waits
            # for a step (a colocated step may prefill a long chunk).
            try:
                self.engine.check_request(rid, list(prompt))
            except RequestError as exc:
                return refuse(str(exc))
            self.grammar.start(params)
            if self.reads is not None and self.reads.can_read:
                # its prefix from a store first (the request is queued when the read ends)
                self.requests.add(rid, RequestPhase.READING, prompt, params, router=req.router)
                self.reads.start(rid, list(prompt), params)
            else:
                self.requests.add(
                    rid,
                    RequestPhase.QUEUED,
                    prompt,
                    params,
                    router=req.router,
                    lease_id=req.lease_id,
                )
                self._wake.set()
            self.first_token.accepted(rid, time.monotonic())
            return ReserveReply(True, self.worker_id)
        async with self._lock:
            if rid in self.requests:  # accepted meanwhile
                return refuse(already)
            reply = self.remote.reserve(req, self._clock() + req.lease_ms / 1000)
        if reply.ok:
            self.grammar.start(params)  # compiled while the prefill runs
        return reply

    def renew(self, request_id: str, lease_id: str, lease_ms: int) -> bool:
        """The lease holder is alive: push the lease deadline ``lease_ms`` from now."""
        return self.pending.renew(request_id, lease_id, self._clock() + lease_ms / 1000)

    def on_completion(self, completion: Completion) -> None:
        """A KV write landed in our pool: one of a reservation's, if from its lease's holder."""
        self.remote.on_completion(completion)

    def on_prefill_started(self, started: PrefillStarted) -> None:
        self.pending.on_started(started.request_id, started.lease_id, started.worker_id)

    def on_worker_gone(self, gone: WorkerGone) -> None:
        self.remote.on_writer_gone(gone.worker_id)

    def on_prefill_done(self, done: PrefillDone) -> None:
        self.remote.on_done(done)

    # ---- requests out: aborts, gone routers, cancelled and expired leases ---------------------

    def abort(self, request_id: str, job_withdrawn: bool = False) -> TokenEvent | None:
        """The client went away. Returns the request's final event when it can be told at once
        (accepted, not yet in the engine); otherwise that event comes from ``admit()`` or
        ``step()``."""
        entry = self.requests.get(request_id)
        was = self.requests.abort(request_id, self._clock())
        if was in (RequestPhase.QUEUED, RequestPhase.READING):
            assert entry is not None
            self.first_token.forget(request_id)
            if self.reads is not None and was is RequestPhase.QUEUED:  # its blocks go with admit()
                self.reads.abort_queued(request_id)
            elif self.reads is not None:  # its prefix is being read: the read frees its blocks
                self.reads.abort_reading(request_id)
            num_prompt_tokens = len(entry.prompt)
            return TokenEvent(
                request_id, (), finish_reason="abort", num_prompt_tokens=num_prompt_tokens
            )
        if was is RequestPhase.RESERVED:
            self.remote.abort(request_id, job_withdrawn)
        elif was is not RequestPhase.SETTLED:  # settled: failed, not admitted, by the next admit()
            self._wake.set()  # in the engine (or unknown): admit() takes the abort there
        return None

    def on_router_gone(self, instance: str) -> list[TokenEvent]:
        """The registry announced the router ``instance`` gone: nobody reads its requests'
        tokens any more, so each is aborted as if its client left, but for a sequence already
        streaming, detached for ``resume_window_s`` (``RequestTable.router_gone``). A
        reservation no prefill worker announced it took frees its blocks at once (every prefill
        worker refuses a job of a gone router); one being written waits for its writer's
        PrefillDone, which comes as the writer stops on the same announcement. Returns the
        final events that can be given now (the rest come from ``admit()`` and ``step()``)."""
        streaming = {rid for rid, seq in self.engine.seqs.items() if seq.num_output_tokens > 0}
        now = self._clock()
        return self._withdraw(
            self.requests.router_gone(instance, now, streaming, self.resume_window_s)
        )

    def hand_over(self, request_id: str, router: str) -> None:
        """The router instance ``router`` took over ``request_id``'s stream (its client resumed
        it there): the stream is that router's from now on, and no longer detached."""
        self.requests.hand_over(request_id, router)

    def expire_detached(self) -> list[TokenEvent]:
        """Abort the detached sequences whose resume window is over; their final events that
        can be given now (the rest come from ``step()``)."""
        expired = self.requests.take_expired_detached(self._clock())
        for request_id in expired:
            log.info("nobody resumed the stream of a gone router", request_id=request_id)
        return self._withdraw(expired)

    def _withdraw(self, request_ids: list[str]) -> list[TokenEvent]:
        """Abort requests nobody streams (their jobs withdrawn): the final events given now."""
        events = (self.abort(rid, job_withdrawn=True) for rid in request_ids)
        return [event for event in events if event is not None]

    @property
    def num_detached(self) -> int:
        return self.requests.num_detached

    def cancel_lease(self, request_id: str, lease_id: str) -> bool:
        """The registry gave up on the reservation it asked for under ``lease_id`` (no reply in
        time; the request went elsewhere): free its blocks at once, as nobody holds its lease
        and nothing can write them, or refuse it if it comes later; a local prefill accepted but
        not started yet is dropped. True if blocks were freed."""
        if self.requests.cancel_queued(request_id, lease_id, self._clock()):
            self.first_token.forget(request_id)
            return False
        return self.remote.cancel(request_id, lease_id)

    def postpone_leases(self, seconds: float) -> None:
        """NATS was down for ``seconds``: no holder could renew (WriteLeaseTable.postpone)."""
        self.pending.postpone(seconds)

    def expire_leases(self) -> list[Abort]:
        """Fail reservations whose lease ran out (``RemotePrefills.expire``): the Aborts that
        tell their prefills to stop."""
        return self.remote.expire(self._clock())

    # ---- state --------------------------------------------------------------------------------

    async def load(self) -> tuple[WorkerLoad, BlockPool]:
        """What the advert and heartbeat report (under the lock: a step mutates the free list)."""
        async with self._lock:
            reading = len(self.reads) if self.reads is not None else 0
            outside = len(self.pending) + self.requests.count(RequestPhase.QUEUED) + reading
            return measure(self.engine, outside, WorkerState.of(self.is_draining))
