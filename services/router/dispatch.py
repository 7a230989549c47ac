"""The router's side of the mesh: who is alive, and each request's life on it.

``Dispatcher.open`` runs one request as a ``MeshRequest`` (mesh_request.py): subscribed to its
event subjects before anything is sent (so no token can be missed), placed by the kv-registry,
its prefill job published unless the decode worker prefills locally; its ``events()`` relays
TokenEvents until one carries a finish_reason. Leaving the block early, by an error, a timeout or
a cancellation (the client went away), publishes ``Abort`` so prefill stops and the reserved
blocks go back. Every wait has a timeout. Heartbeats, adverts and the registry's WorkerGone keep
the worker pools; a request that depended on a lost worker hears it in its own event stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats.errors
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import GatewayTimeoutError
from kvmesh.services.router.mesh_request import MeshRequest, RouterMesh
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.pool_capacity import PoolCapacity
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.queue_health import PrefillQueueHealth
from kvmesh.services.router.recovery import abort_reason
from kvmesh.services.router.stream_ids import Resume
from kvmesh.services.router.stream_resume import ask_replay, find_stream, resume_events
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone, WorkerHeartbeat
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client as NATS

OPTIONAL_ROLES = ("kv-store", "draft")  # heartbeating roles the mesh serves without

log = logs.get_logger(__name__)


class Dispatcher:
    """Runs requests on the mesh over one NATS connection."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: RouterConfig,
        metrics: RouterMetrics,
        model_spec: str = "",
        hearing: Hearing | None = None,
        model_len: int = 0,
    ) -> None:
        """``hearing``: the NATS connection's outages (connect_nats tells it); the worker pools
        count no silence during one."""
        self._nc = nc
        self._subjects = subjects
        self._model_spec = model_spec
        self._config = config
        self._metrics = metrics
        self._live: dict[str, MeshRequest] = {}
        # this process's instance: its heartbeats carry it and its requests are tagged with it,
        # so the mesh drops them when the registry announces this router gone
        self.instance = uuid.uuid4().hex
        self.is_stopping = False  # the router is shutting down: a cancellation is not the client
        now = time.monotonic()
        hearing = hearing or Hearing(connected_since=now)
        self.prefill_pool = WorkerPool(config.worker_liveness_s, now, hearing)
        self.decode_pool = WorkerPool(config.worker_liveness_s, now, hearing)  # or colocated
        self.registry_pool = WorkerPool(config.worker_liveness_s, now, hearing)
        # services the mesh serves without, only slower: /health says "degraded" while one
        # that was heard is silent (a kv-store, a draft worker; issue 43)
        self.optional_pools = {
            role: WorkerPool(config.worker_liveness_s, now, hearing) for role in OPTIONAL_ROLES
        }
        self.prefill_queue = PrefillQueueHealth()  # what publishes found (queue_health.py)
        # the decode workers' KV pools, by adverts: the context a request can use
        self.capacity = PoolCapacity(model_spec, model_len)
        self.mesh = RouterMesh(
            nc,
            subjects,
            config,
            metrics,
            self.prefill_pool,
            self.decode_pool,
            self.registry_pool,
            model_spec,
            self.prefill_queue,
            self.instance,
        )
        self._context_logged: int | None = None

    async def on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        """Prefill, decode and colocated heartbeats: who is alive and ready."""
        pools = {
            "prefill": self.prefill_pool,
            "kv-registry": self.registry_pool,
            **self.optional_pools,
        }
        pool = pools.get(beat.role, self.decode_pool)
        pool.on_heartbeat(beat.worker_id, beat.load.state, time.monotonic())

    def degraded(self, now: float) -> str:
        """What the mesh serves without now ("" if nothing): optional services heard once and
        silent now, e.g. "kv-store (kv-store-0 silent)"."""
        parts = []
        for role, pool in self.optional_pools.items():
            silent = pool.silent(now)
            if silent:
                parts.append(f"{role} ({', '.join(silent)} silent)")
        return "; ".join(parts)

    async def on_advert(self, advert: DecodeAdvert) -> None:
        """Decode adverts: the refusal counters each decode worker reports, for /metrics."""
        self._metrics.record_advert(advert)
        now = time.monotonic()
        self.capacity.note(advert, now)
        context = self.capacity.context(now)
        if context != self._context_logged:  # the first advert, or a pool of another size
            self._context_logged = context
            model_len = self.capacity.model_len
            log.info(
                "max_model_len"
                + (
                    f" {context}: the decode workers' largest KV pool (the model's context is "
                    f"{model_len}; more needs a larger pool: --kv-cache-bytes)"
                    if context < model_len
                    else f" {context}: the model's context"
                ),
                max_model_len=context,
                worker_id=advert.worker_id,
            )

    async def on_worker_gone(self, gone: WorkerGone) -> None:
        """The registry dropped a worker: every request that depended on it hears it now, in its
        own event stream (it retries before its first token, fails after)."""
        self._metrics.forget_worker(gone.worker_id)
        self.capacity.forget(gone.worker_id)
        self.decode_pool.on_gone(gone.worker_id)
        if gone.role == "prefill":
            self.prefill_pool.on_gone(gone.worker_id)
            if self.prefill_pool.num_ready(time.monotonic()) == 0:
                # the last one: queued jobs will never be taken; run them with local prefill
                for request in self._live.values():
                    if not request.is_local_prefill and request.attempts.num_events == 0:
                        request.mark_lost(gone.worker_id)
        for request in list(self._live.values()):
            if request.depends_on(gone.worker_id):
                with contextlib.suppress(nats.errors.Error):
                    await self._nc.publish(
                        self._subjects.request_worker_gone(request.request_id),
                        encode_message(gone),
                    )

    @asynccontextmanager
    async def open(
        self,
        request_id: str,
        prompt: Prompt,
        timer: RequestTimer,
        resume: Resume | None = None,
    ) -> AsyncIterator[MeshRequest]:
        """Place ``prompt`` on the mesh, or take over its stream where a client resumes it
        (``resume``); abort it if the block is left before it finishes."""
        request = MeshRequest(self.mesh, request_id, prompt, timer)
        key = request_id if resume is None else f"{request_id} resumed {id(request)}"
        self._live[key] = request
        try:
            if resume is None:
                await request.subscribe()
                await request.start()
            else:
                await self._take_over(request, resume)
            yield request
            await request.abort("router stopped reading")
        except asyncio.CancelledError:
            await request.abort("router stopping" if self.is_stopping else "client disconnected")
            raise
        except GatewayTimeoutError:
            await request.abort("timeout")
            raise
        except BaseException as exc:
            await request.abort(abort_reason(exc))
            raise
        finally:
            del self._live[key]
            await request.close()

    async def _take_over(self, request: MeshRequest, resume: Resume) -> None:
        """The stream a client resumes here (stream_resume.py): found on its decode worker,
        followed, and its events so far replayed from where the client stopped."""
        timeout_s = self._config.place_timeout_s
        num_workers = self.decode_pool.num_alive(time.monotonic())
        holder = await find_stream(
            self._nc, self._subjects, resume.last.request_id, num_workers, timeout_s
        )
        request.attach(holder.wire_id)
        await request.subscribe()  # before the replay: nothing made after it is missed
        num_prompt_tokens = len(request.attempts.prompt.prompt_ids)
        replay = await ask_replay(
            self._nc, self._subjects, holder, self.instance, num_prompt_tokens, timeout_s
        )
        relayed = resume_events(replay, resume.last, resume.wants_logprobs, holder.wire_id)
        request.adopt(holder.worker_id, replay, relayed)
