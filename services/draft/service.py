"""The draft service's NATS shell around DraftCore (the core) and a Drafter.

Subjects (docs/speculative.md): ``DRAFT_CONTEXT`` in queue group ``draft`` (a sequence's first
context: any draft worker may take it) and ``draft_context(id)`` (the deltas of the sequences this
worker holds) carry DraftContext; ``draft_forget(id)`` DraftForget; ``ABORT`` Abort. Proposals go
to ``decode_draft(decode worker)``. An early-exit or model worker also takes prompt-KV
reservations (``DRAFT_KV_RESERVE``, request/reply in queue group ``draft``) and their prefills'
announcements (``draft_kv_done(id)``, PrefillDone) and receives the KV itself on the data plane
(prompt_kv_receiver.py). Discoverable as micro service ``kvmesh-draft`` ($SRV); its
``status`` endpoint and $SRV.STATS carry the acceptance figures. ``worker_control(id)``
(``kvmesh admin drain|resume``): drained, it leaves the queue group (no new sequence, no new
reservation) and drafts the sequences it holds until they end. The drafting loop drafts what
changed, in batches, in a worker thread, and never blocks the subscriptions: contexts that arrive
meanwhile coalesce into the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import nats.errors
import orjson
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.core import DraftCore
from kvmesh.services.draft.drafters import Drafter, build_drafter
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.prompt_kv_receiver import PromptKvReceiver, target_kv_spec
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import (
    DraftContext,
    DraftForget,
    DraftKvReserve,
    DraftProposal,
)
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.token_streams import Abort
from kvmesh.shared.bus.messages.workers import WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.nats_subscribe import on_message
from kvmesh.shared.bus.service_lifetime import serve_until_signal
from kvmesh.shared.bus.worker_presence import new_worker_id
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.config.subjects import DRAFT_QUEUE_GROUP
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Access, TransportConfig, create_transport
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request

log = logs.get_logger(__name__)


class DraftService:
    """Wires one DraftCore and its Drafter to NATS."""

    def __init__(self, config: DraftConfig, core: DraftCore, drafter: Drafter, nc: Client) -> None:
        self.config = config
        self.role = "draft"
        self.core = core
        self.worker_id = core.worker_id
        self.drafter = drafter
        self.nc = nc
        self.metrics = DraftMetrics()
        self.started_at = time.time()
        self._wake = asyncio.Event()
        self.metrics_port: int | None = None
        # held while the drafter runs its engine; prompt-KV reservations and adoptions (the
        # receiver) touch the same engine's blocks between drafts
        self.lock = asyncio.Lock()
        # early exit and model: prompt KV on the data plane
        self.receiver: PromptKvReceiver | None = None
        self._num_computed = 0
        # the queue group's subjects (a sequence's first context, prompt-KV reservations) and
        # their subscriptions while this worker takes new work (none while drained); each
        # callback is a MessageGuard's (shared/bus/message_guard.py)
        self.queue_routes: list[tuple[str, Callable[[Msg], Awaitable[None]]]] = []
        self._queue_subs: list[Subscription] = []
        self.is_draining = False

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            self.worker_id,
            self.role,
            WorkerLoad(WorkerState.of(self.is_draining), num_running=len(self.core.seqs)),
            started_at=self.started_at,
            sent_at=time.time(),
        )

    def status(self) -> dict:
        return {
            "worker_id": self.core.worker_id,
            "method": self.config.method,
            "k": self.config.num_speculative_tokens,
            "tree": ",".join(map(str, self.config.tree)),
            "state": WorkerState.of(self.is_draining),
            **self.core.stats(),
        }

    async def on_context(self, msg: DraftContext) -> None:
        self.metrics.verified_tokens.inc(msg.num_verified)
        self.metrics.accepted_tokens.inc(msg.num_accepted)
        answer = self.core.on_context(msg, time.monotonic())
        if answer is not None:
            self.metrics.resyncs.inc()
            await self._send(msg.decode_worker_id, answer)
        self.metrics.sequences.set(len(self.core.seqs))
        self._wake.set()

    async def on_forget(self, msg: DraftForget) -> None:
        self.core.forget(msg.request_id)
        self.metrics.sequences.set(len(self.core.seqs))

    async def on_abort(self, msg: Abort) -> None:
        self.core.forget(msg.request_id)
        self.metrics.sequences.set(len(self.core.seqs))

    async def on_worker_gone(self, msg: WorkerGone) -> None:
        if msg.role in ("decode", "colocated") and self.core.forget_worker(msg.worker_id):
            self.metrics.sequences.set(len(self.core.seqs))

    async def on_status(self, req: Request) -> None:
        await req.respond(orjson.dumps(self.status()))

    async def join_queue(self) -> None:
        """Take new work: subscribe to the queue group's subjects (once)."""
        if not self._queue_subs:
            for subject, cb in self.queue_routes:
                sub = await self.nc.subscribe(subject, queue=DRAFT_QUEUE_GROUP, cb=cb)
                self._queue_subs.append(sub)
            await flush_to_server(self.nc)  # the server holds them before the answer says so

    async def leave_queue(self) -> None:
        """Take no new work: the queue group's messages go to the other draft workers (none:
        decode workers decode plainly, prefill workers write no draft KV)."""
        subs, self._queue_subs = self._queue_subs, []
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def on_control(self, action: str) -> None:
        """``kvmesh admin drain|resume <draft worker>``: drained, it takes no new sequence and
        no prompt-KV reservation and drafts the sequences it holds until their decode workers
        forget them; resumed, it takes new ones again."""
        self.is_draining = action == "drain"
        await (self.leave_queue() if self.is_draining else self.join_queue())
        log.warning(f"worker control: {action}", worker_id=self.core.worker_id)

    async def draft_loop(self) -> None:
        """Draft every sequence whose context changed, a batch at a time (a task body)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while jobs := self.core.take_jobs(self.config.max_batch):
                started = time.monotonic()
                async with self.lock:
                    trees = await asyncio.to_thread(self.drafter.propose, jobs)
                self.metrics.draft_seconds.observe(time.monotonic() - started)
                computed = getattr(self.drafter, "num_computed_tokens", None)  # engine drafters
                if computed is not None:
                    self.metrics.context_tokens_computed.inc(computed - self._num_computed)
                    self._num_computed = computed
                for job, (tokens, parents) in zip(jobs, trees, strict=True):
                    proposal = self.core.proposal(job, tokens, parents)
                    if proposal is not None:
                        self.metrics.proposals.inc()
                        await self._send(job.decode_worker_id, proposal)

    async def idle_loop(self) -> None:
        """Drop the contexts nobody updated for --idle-s, once a second (a task body)."""
        while True:
            await asyncio.sleep(min(1.0, self.config.idle_s))
            if self.core.drop_idle(time.monotonic(), self.config.idle_s):
                self.metrics.sequences.set(len(self.core.seqs))

    async def on_kv_reserve(self, msg: Msg) -> None:
        """A prefill worker's request (queue group ``draft``): DraftKvReserve -> its reply."""
        assert self.receiver is not None
        try:
            body = decode_message(msg.data, DraftKvReserve)
        except MessageError as exc:  # nobody can act on it: the prefill times out, goes on
            log.warning("ignored malformed prompt kv reservation", error=str(exc))
            return
        reply = await self.receiver.reserve(body)
        try:
            await msg.respond(encode_message(reply))
        except nats.errors.Error as exc:  # the prefill gave up waiting; the lease frees it
            log.debug("prompt kv reply not sent", request_id=body.request_id, error=str(exc))

    async def on_kv_done(self, msg: PrefillDone) -> None:
        assert self.receiver is not None
        await self.receiver.on_done(msg)

    async def _send(self, decode_worker_id: str, proposal: DraftProposal) -> None:
        try:
            await self.nc.publish(
                self.config.subjects.decode_draft(decode_worker_id), encode_message(proposal)
            )
        except nats.errors.Error as exc:  # the decode worker decodes without it
            log.debug("proposal not sent", request_id=proposal.request_id, error=str(exc))


@contextlib.asynccontextmanager
async def draft_service(config: DraftConfig) -> AsyncIterator[DraftService]:
    """Drafter (models loaded), NATS, subscriptions and the drafting loop: ready to serve."""
    worker_id = config.worker_id or new_worker_id("draft")
    subjects = config.subjects
    async with contextlib.AsyncExitStack() as stack:
        transport = None
        allocate = None
        if config.uses_data_plane:  # early exit, model: prompt KV arrives from prefill workers
            import torch

            bind_host, advertise_host = config.transport_hosts()
            tconf = TransportConfig(
                peer_id=worker_id, tcp_host=bind_host, tcp_advertise_host=advertise_host
            )
            transport = await stack.enter_async_context(create_transport(config.transport, tconf))
            # on the host the draft pool lives in transport memory (shm: a segment prefills map)
            if torch.device(config.device).type == "cpu":
                allocate = transport.allocate
        drafter = await asyncio.to_thread(build_drafter, config, allocate)  # start-up errors first
        nc = await stack.enter_async_context(
            connect_nats(config.nats_url, worker_id, security=config.nats_security)
        )
        service = DraftService(
            config,
            DraftCore(
                worker_id,
                config.max_sequences,
                config.num_speculative_tokens,
                config.pipeline_depth,
            ),
            drafter,
            nc,
        )
        loops = [service.draft_loop, service.idle_loop]
        routes = []
        engine = getattr(drafter, "engine", None)  # the engine drafters' (chains and trees)
        if transport is not None and engine is not None:
            region = transport.register(engine.kv_pool.raw, Access.REMOTE_WRITE)
            whole_blocks = config.method == "model"  # the prefill runs this very checkpoint
            if whole_blocks:
                kv_spec = engine.kv_spec  # what a prefill running it offers (draft_kv_spec)
            else:  # early exit: the first layers of the target's blocks
                from kvmesh.shared.model.loader import load_config_and_tokenizer

                target_layers = load_config_and_tokenizer(config.model)[0].num_hidden_layers
                kv_spec = target_kv_spec(engine, target_layers)
            service.receiver = PromptKvReceiver(
                engine,
                transport,
                region,
                service.lock,
                worker_id=worker_id,
                kv_spec=kv_spec,
                metrics=service.metrics,
                whole_blocks=whole_blocks,
            )
            loops += [service.receiver.completion_loop, service.receiver.expiry_loop]
            routes.append((subjects.draft_kv_done(worker_id), PrefillDone, service.on_kv_done))
        service.queue_routes.append(
            (subjects.DRAFT_CONTEXT, on_message(nc, DraftContext, service.on_context))
        )
        if service.receiver is not None:  # any early-exit or model worker may take one
            reserve = guard_of(nc).raw(service.on_kv_reserve, needs_reply=True)
            service.queue_routes.append((subjects.DRAFT_KV_RESERVE, reserve))
        await service.join_queue()
        try:
            shell = WorkerShell(
                service,
                ready="draft worker ready",
                control=service.on_control,
                endpoints=(("status", subjects.draft_status(worker_id), service.on_status),),
                routes=(
                    (subjects.draft_context(worker_id), DraftContext, service.on_context),
                    (subjects.draft_forget(worker_id), DraftForget, service.on_forget),
                    (subjects.ABORT, Abort, service.on_abort),
                    (subjects.REGISTRY_WORKER_GONE, WorkerGone, service.on_worker_gone),
                    *routes,
                ),
                loops=loops,
                metadata={"method": config.method},
                stats=service.status,
                ready_fields={
                    "method": config.method,
                    "k": config.num_speculative_tokens,
                    "tree": config.tree or None,
                    "transport": transport.name if transport is not None else None,
                },
            )
            async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
                yield service
        finally:
            if not nc.is_closed:
                await service.leave_queue()


async def run(config: DraftConfig) -> None:
    async with draft_service(config):
        await serve_until_signal()
