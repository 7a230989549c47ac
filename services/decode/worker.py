"""The decode worker: one LLMEngine, the pending table, and every path that moves their blocks.

The engine is touched only under ``self._lock``; ``step()`` runs in a worker thread while the lock
is held (torch releases the GIL), so the event loop keeps serving NATS and the data plane
meanwhile. Requests enter three ways: local prefill (``add_request``), a reservation admitted
after its remote prefill (``admit_prefilled``), or not at all (refused). Blocks leave on finish,
abort, failed prefill and lease expiry; each of these paths ends in exactly one final TokenEvent.

The worker knows no NATS. The service (the shell) drives it: it hands in what arrives (reserve,
writes landed, PrefillDone, Abort, renewals), runs the engine loop (``wait_for_work()``, then
``admit()`` and ``step()`` while there is work) and publishes the TokenEvents these return, and the
Aborts ``expire_leases()`` returns.

Features join the loop as step hooks (``step_hooks.py``), composed by the service from its
config: speculative decoding (``speculation.py``), kv-store puts of finished requests
(``store_puts.py``) and swaps of preempted ones (``swaps.py``). The worker calls them at fixed
points, holding its lock, and knows none of them. Local prefills that read their prefix from a
kv-store first (``reads``, a feature the composition hands in: ``local_reads.py``) are part of
how requests enter, not a step hook.

A request with a structured output waits, accepted, until its grammar is compiled: in a thread,
within ``grammar_compile_timeout_s`` (``shared/engine/grammar_compile.py``), never on the event
loop or under the lock, so heartbeats and other streams go on meanwhile. One that fails (or ran
past the limit) gets its final event; its spec is refused at once after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from kvmesh.services.decode.events import failed_event, token_event
from kvmesh.services.decode.first_token import FirstTokenClock
from kvmesh.services.decode.load import WorkerLoad, free_block_ranges
from kvmesh.services.decode.local_reads import LocalPrefixReads
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.pending import Admission, PendingTable, ReservationError, Verdict
from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.shared.bus.messages.placement import ReserveReply, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import Abort, TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.bus.recent_ids import RecentIds
from kvmesh.shared.engine.block_manager import OutOfBlocksError
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.grammar_compile import GrammarCompiles
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError, RequestOutput
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputError
from kvmesh.shared.transport.base import MemoryWindow
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
        self.windows = windows  # one per reservation; None: no remote writers (colocated)
        self.is_draining = False
        self.pending = PendingTable(quarantine_s)
        self._clock = clock
        self._lock = lock or asyncio.Lock()
        self.hooks = tuple(hooks)
        self._wake = wake or asyncio.Event()  # the loop's: shared with ``reads`` when composed
        self._settled: list[Verdict] = []  # reservations leaving the table, applied by admit()
        self._settled_at: dict[str, float] = {}  # request id -> when its verdict came
        self.first_token = FirstTokenClock()  # local prefills' wait and prefill time
        self._aborts: list[str] = []  # running requests to abort, applied by admit()
        # Local-prefill requests accepted by reserve() without waiting for the step in flight,
        # added to the engine by admit() between steps.
        self._incoming: list[tuple[str, list[int], SamplingOptions]] = []
        # None: local prefills use this worker's own prefix cache only, never a kv-store's
        self.reads = reads  # a feature (local_reads.py): it sets ``wake`` when a read ended
        # Requests aborted and leases the registry gave up on, lately: a reservation for one
        # of them that arrives late (its messages took another path) is refused, not held for
        # nobody until its lease runs out.
        self._aborted = RecentIds()
        self._cancelled_leases = RecentIds()
        self._local_leases: dict[str, str] = {}  # accepted local prefill -> its lease id
        # request id -> the instance of the router that holds it (ReserveRequest.router), until
        # its final event: the requests to drop when the registry announces that router gone
        self._routers: dict[str, str] = {}
        self._grammar_compile_timeout_s = grammar_compile_timeout_s
        self.grammars: GrammarCompiles | None = None  # made with the first structured output
        # streaming sequences of a gone router -> when they are aborted unless a router takes
        # them over (a client resumes the stream there: docs/faults.md)
        self.resume_window_s = resume_window_s
        self._detached: dict[str, float] = {}

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
            self._incoming
            or (self.reads is not None and (len(self.reads) or self.reads.has_unused))
            or self._settled
            or self._aborts
            or self.has_unfinished
        )

    async def admit(self) -> list[TokenEvent]:
        """Between steps: add the accepted local-prefill requests to the engine, admit (or fail)
        the reservations that left the pending table, abort the requests their clients left.
        Returns the events to publish before the next step: admitted requests' first tokens,
        failures."""
        events: list[TokenEvent] = []
        async with self._lock:
            if self.reads is not None:  # read: queued now, added below
                self._incoming += self.reads.take_ended()
            incoming, self._incoming = self._incoming, []
            self._local_leases.clear()
            if self.reads is not None:
                self.reads.adopt_unused()
            for rid, prompt, params in incoming:
                try:
                    if not self._grammar_ready(params):
                        self._incoming.append((rid, prompt, params))  # next time
                        continue
                except StructuredOutputError as exc:
                    if self.reads is not None:  # what was read stays cached
                        self.reads.adopt_for(rid)
                    self.first_token.forget(rid)
                    events.append(failed_event(rid, len(prompt), f"request {rid!r}: {exc}"))
                    continue
                if self.reads is not None:  # adopted and added at once
                    self.metrics.store_hit_tokens.inc(self.reads.adopt_for(rid))
                self.metrics.local_prompt_tokens.inc(len(prompt))
                try:
                    self.engine.add_request(rid, prompt, params)
                except RequestError as exc:
                    self.first_token.forget(rid)
                    events.append(failed_event(rid, len(prompt), str(exc)))
            settled, self._settled = self._settled, []
            for verdict in settled:
                if not self._grammar_settled(verdict):
                    self._settled.append(verdict)  # admitted once its grammar is compiled
                    continue
                event = self._apply(verdict)
                if event is not None:
                    events.append(event)
            aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                self.engine.abort(request_id)  # its "abort" output comes with the next step
            work = [w for hook in self.hooks if (w := hook.between_steps(self.engine))]
        for coroutine in work:  # e.g. a swap-in's read, before the step that readmits it
            await coroutine  # (the lock released: a hook's work takes it where it must)
        return self._ended(events)

    def _grammar_ready(self, params: SamplingOptions) -> bool:
        """Whether the request's grammar is compiled (or it has none): ``add_request`` then
        compiles nothing. StructuredOutputError: it failed."""
        spec = params.structured_outputs
        if spec is None or self.engine.grammars is None:
            return True  # none, or the engine refuses it (no tokenizer)
        if self.grammars is None:
            loop = asyncio.get_running_loop()
            self.grammars = GrammarCompiles(
                self.engine.grammars,
                self._grammar_compile_timeout_s,
                lambda: _call_soon(loop, self._wake.set),
            )
        self.grammars.start(spec)
        return self.grammars.ready(spec)

    def _grammar_settled(self, verdict: Verdict) -> bool:
        """Whether a settled reservation can be applied now: not one to admit, or its grammar
        compiled or failed (``admit_prefilled`` then refuses it at once)."""
        if not verdict.ok or verdict.lease.is_aborted:
            return True
        assert verdict.lease.admission is not None
        try:
            return self._grammar_ready(verdict.lease.admission.params)
        except StructuredOutputError:
            return True

    def close(self) -> None:
        """Stop the grammar compile threads (a compile in flight ends on its own)."""
        if self.grammars is not None:
            self.grammars.close()

    async def step(self) -> list[TokenEvent]:
        """One engine step (in a worker thread, holding the lock); returns its token events."""
        async with self._lock:
            if not self.engine.has_unfinished():
                return []
            trees: dict[str, DraftTree] = {}
            for hook in self.hooks:
                plan = hook.before_step(self.engine)
                if plan is not None:
                    trees.update(plan.drafts)
            # a finished sequence is gone after the step; only hooks look at it then
            before = dict(self.engine.seqs) if self.hooks else {}
            step_started = time.monotonic()
            outputs = await asyncio.to_thread(self.engine.step, trees or None)
            step_ended = time.monotonic()
            seconds = step_ended - step_started
            if len(self.first_token):
                self._time_first_tokens(outputs, step_started, step_ended)
            self.metrics.observe_step(
                seconds,
                batch_size=sum(1 for out in outputs if out.new_token_ids),
                num_tokens=sum(len(out.new_token_ids) for out in outputs),
                num_preemptions=self.engine.scheduler.num_preemptions,
            )
            bm = self.engine.block_manager
            self.metrics.observe_prefix_cache(bm.num_hit_tokens, len(bm.hash_to_block))
            step = Step(outputs, trees, seconds, before)
            for hook in self.hooks:
                hook.after_step(self.engine, step)
        return self._ended([event for out in outputs if (event := self._event(out)) is not None])

    def _ended(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """``events``, their requests that end forgotten by router (``on_router_gone``)."""
        for event in events:
            if event.finish_reason is not None:
                self._routers.pop(event.request_id, None)
                self._detached.pop(event.request_id, None)
        return events

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
        """``_token_event`` with the decode worker's first-token times on a first event."""
        event = token_event(out)
        if event is not None and len(self.first_token):
            wait_s, prefill_s = self.first_token.take(out.request_id)
            if out.finished:
                self.first_token.forget(out.request_id)
            if wait_s or prefill_s:
                event = msgspec.structs.replace(event, wait_s=wait_s, prefill_s=prefill_s)
        return event

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
        rid, prompt = req.request_id, list(req.prompt_ids)
        if self._aborted.seen(rid, self._clock()):
            return refuse(f"request {rid!r} was aborted before its reservation arrived")
        if self._cancelled_leases.seen(req.lease_id, self._clock()):
            return refuse(f"the registry gave up on lease {req.lease_id} before it arrived")
        if (
            rid in self.pending
            or (self.reads is not None and rid in self.reads)
            or any(rid == r for r, _, _ in self._incoming)
        ):
            return refuse(f"request {rid!r} is already on decode worker {self.worker_id}")
        if req.local_prefill or self.colocated:
            # Accepted now, queued by the engine after the step in flight: the reply never waits
            # for a step (a colocated step may prefill a long chunk).
            try:
                self.engine.check_request(rid, prompt)
            except RequestError as exc:
                return refuse(str(exc))
            self._start_grammar(params)
            if self.reads is not None and self.reads.can_read:
                # its prefix from a store first (the request is queued when the read ends)
                self.reads.start(rid, prompt, params)
            else:
                self._incoming.append((rid, prompt, params))
                self._local_leases[rid] = req.lease_id
                self._wake.set()
            self.first_token.accepted(rid, time.monotonic())
            self._tag(rid, req.router)
            return ReserveReply(True, self.worker_id)
        async with self._lock:
            if rid in self.engine.seqs:
                return refuse(f"request {rid!r} is already on decode worker {self.worker_id}")
            if not prompt or len(prompt) > self.engine.max_model_len:
                return refuse(
                    f"prompt of {len(prompt)} tokens; this worker takes 1..{self.engine.max_model_len}"
                )
            if not self.engine.can_reserve(len(prompt), params.max_tokens, self._owed_to_pending()):
                return refuse(
                    f"decode worker {self.worker_id} is out of KV blocks: no room for "
                    f"{len(prompt)} prompt tokens plus the output room of the requests it holds"
                )
            try:
                block_ids = self.engine.reserve_blocks(len(prompt))
            except OutOfBlocksError as exc:
                return refuse(f"decode worker {self.worker_id} is out of KV blocks: {exc}")
            slot = imm_slot(self.base_addr + block_ids[0] * self.block_bytes, self.block_bytes)
            deadline = self._clock() + req.lease_ms / 1000
            try:
                window = self.windows.open(block_ids) if self.windows else None
            except ValueError as exc:  # the transport's table of windows is full
                self.engine.free_reserved(block_ids)
                return refuse(f"decode worker {self.worker_id} cannot open a write window: {exc}")
            try:
                res = self.pending.add(
                    rid,
                    req.lease_id,
                    slot,
                    tuple(block_ids),
                    deadline,
                    Admission(tuple(prompt), params),
                    window,
                )
            except ReservationError as exc:
                self._close_window(window)
                self.engine.free_reserved(block_ids)
                return refuse(str(exc))
        self._start_grammar(params)  # compiled while the prefill runs
        self._tag(rid, req.router)
        return ReserveReply(
            True,
            self.worker_id,
            block_ids=tuple(block_ids),
            rkey=res.rkey,
            block_addrs=tuple(self.base_addr + b * self.block_bytes for b in block_ids),
        )

    def _tag(self, request_id: str, router: str) -> None:
        if router:
            self._routers[request_id] = router

    def _start_grammar(self, params: SamplingOptions) -> None:
        with contextlib.suppress(StructuredOutputError):  # failed lately: admit() says so
            self._grammar_ready(params)

    def _close_window(self, window: MemoryWindow | None) -> None:
        if window is not None and self.windows is not None:
            self.windows.close(window)

    def _owed_to_pending(self) -> int:
        """Output room the reservations in flight will need once admitted."""
        room = self.engine.scheduler.output_room
        owed = 0
        for r in self.pending.reservations():
            assert r.admission is not None
            owed += room(
                len(r.admission.prompt_ids), r.admission.params.max_tokens, len(r.block_ids)
            )
        return owed

    def renew(self, request_id: str, lease_id: str, lease_ms: int) -> bool:
        """The lease holder is alive: push the lease deadline ``lease_ms`` from now."""
        return self.pending.renew(request_id, lease_id, self._clock() + lease_ms / 1000)

    def on_completion(self, completion: Completion) -> None:
        """A KV write landed in our pool (one of the transport's completions, whose immediate
        is 32 bits by construction); it counts only if it came from its lease's holder."""
        slot, chunk = unpack_imm(completion.imm)
        verdict = self.pending.on_immediate(slot, chunk, completion.keys, completion.peer_id)
        if verdict is not None:
            self._settle(verdict)

    def on_prefill_started(self, started: PrefillStarted) -> None:
        self.pending.on_started(started.request_id, started.lease_id, started.worker_id)

    def on_worker_gone(self, gone: WorkerGone) -> None:
        for verdict in self.pending.on_writer_gone(gone.worker_id):
            log.warning(
                "prefill worker died; blocks released",
                request_id=verdict.lease.request_id,
                worker_id=gone.worker_id,
            )
            self._settle(verdict)

    def on_router_gone(self, instance: str) -> list[TokenEvent]:
        """The registry announced the router ``instance`` gone: nobody reads its requests'
        tokens any more, so each is aborted as if its client left. A reservation no prefill
        worker announced it took frees its blocks at once (its window closes, and every
        prefill worker refuses a job of a gone router); one being written waits for its
        writer's PrefillDone, which comes as the writer stops on the same announcement.
        Returns the final events that can be given now (the rest come from ``admit()`` and
        ``step()``)."""
        if not instance:
            return []
        events = []
        for request_id in [r for r, router in self._routers.items() if router == instance]:
            del self._routers[request_id]
            if self._is_streaming(request_id) and self.resume_window_s > 0:
                self._detached[request_id] = self._clock() + self.resume_window_s
                continue  # its client may resume it through another router
            event = self.abort(request_id, job_withdrawn=True)
            if event is not None:
                events.append(event)
        return events

    def _is_streaming(self, request_id: str) -> bool:
        seq = self.engine.seqs.get(request_id)
        return seq is not None and seq.num_output_tokens > 0

    def hand_over(self, request_id: str, router: str) -> None:
        """The router instance ``router`` took over ``request_id``'s stream (its client resumed
        it there): the stream is that router's from now on, and no longer detached."""
        if request_id in self._routers or self._detached.pop(request_id, None) is not None:
            self._routers[request_id] = router

    def expire_detached(self) -> list[TokenEvent]:
        """Abort the detached sequences whose resume window is over; their final events that
        can be given now (the rest come from ``step()``)."""
        now = self._clock()
        events = []
        for request_id in [r for r, until in self._detached.items() if now >= until]:
            del self._detached[request_id]
            log.info("nobody resumed the stream of a gone router", request_id=request_id)
            event = self.abort(request_id, job_withdrawn=True)
            if event is not None:
                events.append(event)
        return events

    @property
    def num_detached(self) -> int:
        return len(self._detached)

    def on_prefill_done(self, done: PrefillDone) -> None:
        verdict = self.pending.on_done(done)
        if verdict is not None:
            self._settle(verdict)

    def abort(self, request_id: str, job_withdrawn: bool = False) -> TokenEvent | None:
        """The client went away. Returns the request's final event when it can be told at once
        (accepted, not yet in the engine); otherwise that event comes from ``admit()`` or
        ``step()``."""
        self._aborted.add(request_id, self._clock())
        self._routers.pop(request_id, None)  # its final event comes, or none is owed
        self._detached.pop(request_id, None)
        for i, (rid, prompt, _) in enumerate(self._incoming):  # accepted, not yet in the engine
            if rid == request_id:
                del self._incoming[i]
                self.first_token.forget(rid)
                if self.reads is not None:  # its blocks are adopted by the next admit()
                    self.reads.abort_queued(rid)
                return TokenEvent(rid, (), finish_reason="abort", num_prompt_tokens=len(prompt))
        reading = self.reads.abort_reading(request_id) if self.reads is not None else None
        if reading is not None:  # its prefix is being read: the read frees its blocks
            self.first_token.forget(request_id)
            prompt = reading
            return TokenEvent(request_id, (), finish_reason="abort", num_prompt_tokens=len(prompt))
        if request_id in self.pending:
            verdict = self.pending.abort(request_id, job_withdrawn)
            if verdict is not None:
                self._settle(verdict)
            return None
        for verdict in self._settled:  # settled, not yet admitted: free it instead
            if verdict.lease.request_id == request_id:
                verdict.lease.is_aborted = True
                return None
        self._aborts.append(request_id)
        self._wake.set()
        return None

    def cancel_lease(self, request_id: str, lease_id: str) -> bool:
        """The registry gave up on the reservation it asked for under ``lease_id`` (no reply in
        time; the request went elsewhere): free its blocks at once, as nobody holds its lease
        and nothing can write them, or refuse it if it comes later; a local prefill accepted but
        not started yet is dropped. True if blocks were freed."""
        self._cancelled_leases.add(lease_id, self._clock())
        if self._local_leases.get(request_id) == lease_id:  # accepted, not in the engine yet
            del self._local_leases[request_id]
            self._routers.pop(request_id, None)
            self._incoming = [entry for entry in self._incoming if entry[0] != request_id]
            return False
        res = self.pending.get(request_id)
        if res is None or res.lease_id != lease_id:
            return False
        if res.writer or res.writes or res.done is not None:  # someone writes: not a lost reply
            return False
        verdict = self.pending.abort(request_id, job_withdrawn=True)
        assert verdict is not None and not verdict.notify  # the request lives elsewhere
        self._settle(verdict)
        return True

    def postpone_leases(self, seconds: float) -> None:
        """NATS was down for ``seconds``: no holder could renew (WriteLeaseTable.postpone)."""
        self.pending.postpone(seconds)

    def expire_leases(self) -> list[Abort]:
        """Fail reservations whose lease ran out; their blocks are quarantined until their
        prefill has stopped writing (see PendingTable). Returns the Aborts that tell those
        prefills to stop, one per lease that newly expired."""
        aborts = []
        for verdict in self.pending.expire(self._clock()):
            res = verdict.lease
            if verdict.notify:
                log.warning("lease expired", request_id=res.request_id, error=verdict.error)
                aborts.append(Abort(res.request_id, reason="lease expired"))
            self._settle(verdict)
        return aborts

    def _settle(self, verdict: Verdict) -> None:
        """Hand a reservation that left the table (or whose lease expired) to ``admit()``
        (admit or free). Its window closes now: no write may land in its blocks any more."""
        self._close_window(verdict.lease.window)  # closing twice is harmless
        self._settled.append(verdict)
        self._settled_at.setdefault(verdict.lease.request_id, time.monotonic())
        self._wake.set()

    def _apply(self, verdict: Verdict) -> TokenEvent | None:
        """Admit a prefilled request (its first token) or fail it: free its blocks (unless
        quarantined) and return its final event (unless the client was already told).
        Called by admit() with the lock held, between steps."""
        res = verdict.lease
        assert res.admission is not None
        prompt, params = list(res.admission.prompt_ids), res.admission.params
        error = verdict.error
        settled_at = self._settled_at.pop(res.request_id, None)
        wait_s = 0.0 if settled_at is None else max(0.0, time.monotonic() - settled_at)
        if verdict.ok and not res.is_aborted:
            assert res.done is not None
            try:
                self.engine.admit_prefilled(
                    res.request_id,
                    prompt,
                    list(res.block_ids),
                    res.done.first_token,
                    params,
                    res.done.first_logprobs,
                    res.done.prompt_logprobs,
                )
            except RequestError as exc:
                error = str(exc)
            else:  # the prefill sampled the first token; the engine's outputs follow it
                for hook in self.hooks:
                    hook.on_admitted(res.request_id, res.done)
                first = (res.done.first_token,)
                lps = (res.done.first_logprobs,) if res.done.first_logprobs is not None else ()
                return TokenEvent(
                    res.request_id,
                    first,
                    num_prompt_tokens=len(prompt),
                    num_output_tokens=1,
                    wait_s=wait_s,
                    logprobs=lps,
                    prompt_logprobs=res.done.prompt_logprobs,
                )
        self._routers.pop(res.request_id, None)  # not admitted: it ends here
        if verdict.release:
            self.engine.free_reserved(list(res.block_ids))
        if not verdict.notify:
            return None
        return TokenEvent(
            res.request_id,
            (),
            finish_reason="abort" if res.is_aborted else "error",
            num_prompt_tokens=len(prompt),
            error="" if res.is_aborted else f"prefill failed: {error}",
        )

    # ---- state --------------------------------------------------------------------------------

    async def load(self) -> WorkerLoad:
        """What the advert and heartbeat report (under the lock: a step mutates the free list)."""
        async with self._lock:
            bm = self.engine.block_manager
            return WorkerLoad(
                total_blocks=bm.num_total_blocks,
                free_blocks=bm.num_free_blocks,
                free_block_ranges=free_block_ranges(bm.free),
                num_running=len(self.engine.scheduler.running),
                num_waiting=len(self.engine.scheduler.waiting)
                + len(self.pending)
                + len(self._incoming)
                + (len(self.reads) if self.reads is not None else 0),
                state="draining" if self.is_draining else "ready",
            )


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop``, from another thread (nothing once the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
