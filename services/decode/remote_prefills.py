"""A decode worker's side of remote prefills: blocks reserved under write leases, then admitted.

``reserve`` (under the engine lock) checks the room, takes the blocks, opens their write window
and records the reservation: its lease in the pending table (``pending.py``: the lease rules),
its request ``RESERVED`` in the request table. The lease's events (writes landed, PrefillDone,
expiry, an abort, a writer or the registry giving up) may give a verdict: it closes the window
at once and settles the request in the request table; ``apply``, between steps, admits it into
the engine with the first token its prefill sampled, or fails it, its blocks freed unless
quarantined.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvmesh.services.decode.pending import Admission, PendingTable, ReservationError, Verdict
from kvmesh.services.decode.request_table import RequestPhase, RequestTable
from kvmesh.services.decode.step_hooks import StepHook
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.shared.bus.messages.placement import ReserveReply, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.token_streams import Abort, TokenEvent
from kvmesh.shared.engine.block_manager import OutOfBlocksError
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.base import MemoryWindow
from kvmesh.shared.transport.completions import Completion

log = logs.get_logger(__name__)


class RemotePrefills:
    def __init__(
        self,
        engine: LLMEngine,
        requests: RequestTable,
        wake: Callable[[], None],
        *,
        worker_id: str,
        base_addr: int,
        windows: LeaseWindows | None,
        quarantine_s: float,
        hooks: Sequence[StepHook],
    ) -> None:
        """``wake``: a verdict came, for ``admit()``; ``base_addr``: the receiving region's
        address (blocks at base + id * bytes); ``windows``: one per reservation (None: no
        remote writers, colocated); ``hooks``: told of each admitted request (``on_admitted``)."""
        self.engine = engine
        self.requests = requests
        self._wake = wake
        self.worker_id = worker_id
        self.base_addr = base_addr
        self.block_bytes = engine.kv_pool.spec.block_bytes
        self.windows = windows
        # the lease rules; a tensor-parallel worker's windows count every rank's writes
        self.pending = (
            windows.pending_table(quarantine_s) if windows else PendingTable(quarantine_s)
        )
        self.hooks = hooks

    def reserve(self, req: ReserveRequest, deadline: float) -> ReserveReply:
        """Reserve the blocks of ``req``'s prompt under its lease, until ``deadline`` (called
        under the engine lock)."""
        refuse = lambda error: ReserveReply(False, self.worker_id, error=error)
        engine, rid, prompt, params = self.engine, req.request_id, req.prompt_ids, req.sampling
        if rid in engine.seqs:
            return refuse(f"request {rid!r} is already on decode worker {self.worker_id}")
        if not prompt or len(prompt) > engine.max_model_len:
            return refuse(
                f"prompt of {len(prompt)} tokens; this worker takes 1..{engine.max_model_len}"
            )
        if not engine.can_reserve(len(prompt), params.max_tokens, self._owed()):
            return refuse(
                f"decode worker {self.worker_id} is out of KV blocks: no room for "
                f"{len(prompt)} prompt tokens plus the output room of the requests it holds"
            )
        try:
            block_ids = engine.reserve_blocks(len(prompt))
        except OutOfBlocksError as exc:
            return refuse(f"decode worker {self.worker_id} is out of KV blocks: {exc}")
        slot = imm_slot(self.base_addr + block_ids[0] * self.block_bytes, self.block_bytes)
        try:
            window = self.windows.open(block_ids) if self.windows else None
        except ValueError as exc:  # the transport's table of windows is full
            engine.free_reserved(block_ids)
            return refuse(f"decode worker {self.worker_id} cannot open a write window: {exc}")
        try:
            res = self.pending.add(
                rid,
                req.lease_id,
                slot,
                tuple(block_ids),
                deadline,
                window,
                admission=Admission(tuple(prompt), params),
            )
        except ReservationError as exc:
            self.close_window(window)
            engine.free_reserved(block_ids)
            return refuse(str(exc))
        self.requests.add(rid, RequestPhase.RESERVED, prompt, params, router=req.router)
        return ReserveReply(
            True,
            self.worker_id,
            block_ids=tuple(block_ids),
            rkey=res.rkey,
            block_addrs=tuple(self.base_addr + b * self.block_bytes for b in block_ids),
            ranks=self.windows.ranks(window) if self.windows else (),
        )

    def _owed(self) -> int:
        """Output room the reservations in flight will need once admitted."""
        room = self.engine.scheduler.output_room
        owed = 0
        for r in self.pending.reservations():
            assert r.admission is not None
            owed += room(
                len(r.admission.prompt_ids), r.admission.params.max_tokens, len(r.block_ids)
            )
        return owed

    def close_window(self, window: MemoryWindow | None) -> None:
        """No write may land in the window's blocks any more (closing twice is harmless)."""
        if window is not None and self.windows is not None:
            self.windows.close(window)

    # ---- the lease's events -------------------------------------------------------------------

    def on_completion(self, completion: Completion) -> None:
        """A KV write landed in our pool (one of the transport's completions, whose immediate
        is 32 bits by construction); it counts only if it came from its lease's holder."""
        slot, chunk = unpack_imm(completion.imm)
        self._settle(self.pending.on_immediate(slot, chunk, completion.keys, completion.peer_id))

    def on_done(self, done: PrefillDone) -> None:
        self._settle(self.pending.on_done(done))

    def on_writer_gone(self, writer: str) -> None:
        for verdict in self.pending.on_writer_gone(writer):
            log.warning(
                "prefill worker died; blocks released",
                request_id=verdict.lease.request_id,
                worker_id=writer,
            )
            self._settle(verdict)

    def abort(self, request_id: str, job_withdrawn: bool) -> None:
        """The client went away (``PendingTable.abort``)."""
        self._settle(self.pending.abort(request_id, job_withdrawn))

    def expire(self, now: float) -> list[Abort]:
        """Fail reservations whose lease ran out; their blocks are quarantined until their
        prefill has stopped writing (see PendingTable). Returns the Aborts that tell those
        prefills to stop, one per lease that newly expired."""
        aborts = []
        for verdict in self.pending.expire(now):
            res = verdict.lease
            if verdict.notify:
                log.warning("lease expired", request_id=res.request_id, error=verdict.error)
                aborts.append(Abort(res.request_id, reason="lease expired"))
            self._settle(verdict)
        return aborts

    def cancel(self, request_id: str, lease_id: str) -> bool:
        """The registry gave up on ``lease_id`` (no reply in time; the request went elsewhere):
        its reservation fails at once if nothing was written yet (a lost reply, not a slow
        prefill); then nobody holds its lease and nothing can write its blocks. True if its
        blocks are freed."""
        res = self.pending.get(request_id)
        if res is None or res.lease_id != lease_id:
            return False
        if res.writer or res.writes or res.done is not None:  # someone writes: not a lost reply
            return False
        verdict = self.pending.abort(request_id, job_withdrawn=True)
        assert verdict is not None and not verdict.notify  # the request lives elsewhere
        self._settle(verdict)
        return True

    def on_verdict(self, verdict: Verdict | None) -> None:
        """A verdict the table gave on news the worker does not see itself: a tensor-parallel
        worker's other ranks' writes (``tp_group.py``)."""
        self._settle(verdict)

    def _settle(self, verdict: Verdict | None) -> None:
        """A lease's verdict to the request table, for ``admit()`` (admit or free). Its window
        closes now: no write may land in its blocks any more."""
        if verdict is None:
            return
        self.close_window(verdict.lease.window)  # closing twice is harmless
        self.requests.settle(verdict, time.monotonic())
        self._wake()

    # ---- between steps --------------------------------------------------------------------------

    def apply(self, verdict: Verdict, settled_at: float | None = None) -> list[TokenEvent]:
        """Between steps, holding the lock: admit a prefilled request (its first token) or fail
        it: free its blocks (unless quarantined) and give its final event (unless the client
        was already told). ``settled_at``: when the verdict came (its admission wait)."""
        admitted, event = self._apply(verdict, settled_at)
        rid = verdict.lease.request_id
        entry = self.requests.get(rid)
        if entry is not None and entry.verdict is verdict:  # else no request's any more
            if admitted:
                self.requests.started(rid)
            else:
                self.requests.end(rid)
        return [event] if event is not None else []

    def _apply(self, verdict: Verdict, settled_at: float | None) -> tuple[bool, TokenEvent | None]:
        res = verdict.lease
        assert res.admission is not None
        prompt, params = list(res.admission.prompt_ids), res.admission.params
        error = verdict.error
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
                return True, TokenEvent(
                    res.request_id,
                    first,
                    num_prompt_tokens=len(prompt),
                    num_output_tokens=1,
                    wait_s=wait_s,
                    logprobs=lps,
                    prompt_logprobs=res.done.prompt_logprobs,
                )
        if verdict.release:
            self.engine.free_reserved(list(res.block_ids))
        if not verdict.notify:
            return False, None
        return False, TokenEvent(
            res.request_id,
            (),
            finish_reason="abort" if res.is_aborted else "error",
            num_prompt_tokens=len(prompt),
            error="" if res.is_aborted else f"prefill failed: {error}",
        )
