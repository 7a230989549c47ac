"""A small mesh peer for router tests: speaks the real protocol on a real NATS server.

It answers ``REGISTRY_PLACE`` like the kv-registry, takes ``PREFILL_JOBS`` like a prefill worker
(publishing a PrefillReport), and publishes ``TokenEvent``s like a decode worker: the bytes of
``reply_text`` (kvmesh-tiny's tokenizer is byte-level), one token per event, until ``max_tokens``
("length") or the end of the reply (EOS, "stop"). It records what it received, Aborts included,
and stops generating a request when it is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvmesh.services.prefill_queue.keeper import ensure_queue
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import LeaseRenew, PlaceReply, PlaceRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob, PrefillReport
from kvmesh.shared.bus.messages.token_streams import Abort, TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.model.tiny import tiny_config
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)

EOS_ID = tiny_config().eos_token_ids[0]
REPLY_TEXT = "The quick brown fox jumps over the lazy dog. "


@dataclass
class FakeMesh:
    nats_url: str
    mesh: str = DEFAULT_MESH  # the router's (kvmesh-tiny's unless it says otherwise)
    reply_text: str = REPLY_TEXT
    eos_at_end: bool = True  # after reply_text: EOS ("stop"); else repeat it until max_tokens
    token_delay_s: float = 0.0
    retry_after_s: float = 0.0  # > 0: refuse placement as overloaded
    overloaded_places: int = -1  # with retry_after_s: refuse this many, then place (-1: all)
    refuse_error: str = ""  # non-empty: refuse placement without retry
    hold_tokens: bool = False  # place, but never produce tokens
    hold_first: bool = False  # never produce tokens for the first placement only
    prefill_alive: bool = True  # heartbeat as a ready prefill worker (the router watches)
    decode_alive: bool = True  # heartbeat as a ready decode worker (readiness, 503)
    # heartbeat as a kv-registry: a router that heard one waits for it through an outage
    # (no responders right after a reconnect) instead of answering 503 at once
    registry_alive: bool = True
    make_queue: bool = True  # make the prefill queue (the keeper's part); False: a mesh without
    # heartbeat as these optional services (kv-store, draft) while they are in the set
    optional_alive: set[str] = field(default_factory=set)
    fail_with: str = ""  # end each request with finish_reason "error" after the first token
    # a model that continues its reply: a prompt longer than the first placement's by n tokens
    # (a migrated stream: prompt + output so far) gets the reply from its n-th token on
    continue_reply: bool = False
    lose_token: int = 0  # > 0: the first placement's event of this token (1-based) is lost
    unanswered_places: int = 0  # the first this many placements get no reply (a registry died)
    places: list[PlaceRequest] = field(default_factory=list)
    jobs: list[PrefillJob] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
    renewals: list[LeaseRenew] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.mesh)

    def output_ids(self, max_tokens: int, offset: int = 0) -> tuple[list[int], str]:
        text = self.reply_text.encode()
        if self.eos_at_end:
            ids = [*text, EOS_ID][offset:]
            return (ids, "stop") if len(ids) <= max_tokens else (ids[:max_tokens], "length")
        ids = (list(text) * (max_tokens // len(text) + 1))[:max_tokens]
        return ids, "length"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[FakeMesh]:
        async with connect_nats(self.nats_url, "fake-mesh") as nc:
            self._nc = nc
            if self.make_queue:
                await ensure_queue(nc, self.subjects)  # the keeper's part: the router makes none
            subs = [
                await nc.subscribe(self.subjects.REGISTRY_PLACE, cb=self._on_place),
                await nc.subscribe(self.subjects.ABORT, cb=self._on_abort),
                await nc.subscribe(self.subjects.DECODE_LEASE_RENEW_ALL, cb=self._on_renew),
            ]
            if self.make_queue:  # sees the publish (without a queue nothing hears it)
                subs.append(await nc.subscribe(self.subjects.PREFILL_JOBS, cb=self._on_job))
            await flush_to_server(nc)
            beating = asyncio.create_task(self._heartbeat())
            try:
                yield self
            finally:
                beating.cancel()
                for sub in subs:
                    await sub.unsubscribe()
                for task in self._tasks.values():
                    task.cancel()
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _heartbeat(self) -> None:
        """Heartbeats of a prefill and a decode worker and a kv-registry; set prefill_alive /
        decode_alive / registry_alive to False to "kill" one."""
        while True:
            roles = (
                ("prefill", self.prefill_alive),
                ("decode", self.decode_alive),
                ("kv-registry", self.registry_alive),
                *((role, True) for role in sorted(self.optional_alive)),
            )
            for role, alive in roles:
                if alive:
                    beat = WorkerHeartbeat(
                        worker_id=f"{role}-fake",
                        role=role,
                        load=WorkerLoad("ready", num_running=0, num_waiting=0),
                        started_at=0.0,
                        sent_at=0.0,
                    )
                    subject = self.subjects.heartbeat(role, f"{role}-fake")
                    await self._nc.publish(subject, encode_message(beat))
            await asyncio.sleep(0.2)

    async def _on_renew(self, msg) -> None:
        self.renewals.append(decode_message(msg.data, LeaseRenew))

    async def _on_place(self, msg) -> None:
        place = decode_message(msg.data, PlaceRequest)
        self.places.append(place)
        if len(self.places) <= self.unanswered_places:
            return
        overloaded = self.retry_after_s > 0 and (
            self.overloaded_places < 0 or len(self.places) <= self.overloaded_places
        )
        if overloaded or self.refuse_error:
            reply = PlaceReply(
                ok=False,
                request_id=place.request_id,
                error=self.refuse_error or "no free blocks",
                retry_after_s=self.retry_after_s,
            )
        else:
            reply = PlaceReply(
                ok=True,
                request_id=place.request_id,
                worker_id="decode-fake",
                lease_id=f"lease-{place.request_id}",
                descriptor=TransportDescriptor(
                    "decode-fake", "h", (TcpBackend("127.0.0.1", 1, SECRET),)
                ),
                rkey=7,
                block_ids=(0, 1),
                block_addrs=(4096, 8192),
                block_bytes=4096,
            )
        await msg.respond(encode_message(reply))
        if reply.ok and place.local_prefill:
            self._start(place.request_id, place.prompt_ids, place.sampling)

    async def _on_job(self, msg) -> None:
        job = decode_message(msg.data, PrefillJob)
        self.jobs.append(job)
        report = PrefillReport(
            request_id=job.request_id,
            worker_id="prefill-fake",
            queue_s=0.002,
            compute_s=0.03,
            transfer_s=0.01,
            exposed_transfer_s=0.001,
            num_chunks=2,
        )
        await self._nc.publish(
            self.subjects.request_prefill_report(job.request_id), encode_message(report)
        )
        self._start(job.request_id, job.prompt_ids, job.sampling)

    async def _on_abort(self, msg) -> None:
        abort = decode_message(msg.data, Abort)
        self.aborts.append(abort)
        self.aborted.set()
        task = self._tasks.get(abort.request_id)
        if task is not None:
            task.cancel()

    def _start(
        self, request_id: str, prompt_ids: tuple[int, ...], sampling: SamplingOptions
    ) -> None:
        if self.hold_first and len(self.places) == 1:
            return
        if not self.hold_tokens:
            offset = len(prompt_ids) - len(self.places[0].prompt_ids) if self.continue_reply else 0
            self._tasks[request_id] = asyncio.create_task(
                self._generate(
                    request_id,
                    len(prompt_ids),
                    sampling.max_tokens,
                    offset,
                    sampling.logprobs,
                    sampling.n,
                    _prompt_logprobs(prompt_ids, sampling.prompt_logprobs),
                )
            )

    async def _generate(
        self,
        request_id: str,
        num_prompt: int,
        max_tokens: int,
        offset: int = 0,
        logprobs: int | None = None,
        num_choices: int = 1,
        prompt_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        """The reply's tokens, one event each; with n > 1 each choice in turn gets them."""
        ids, reason = self.output_ids(max_tokens, offset)
        subject = self.subjects.request_tokens(request_id)
        for index, i, token_id in (
            (c, i, t) for c in range(num_choices) for i, t in enumerate(ids)
        ):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == len(ids) - 1
            failing = bool(self.fail_with) and i == 1
            event = TokenEvent(
                request_id=request_id,
                token_ids=(token_id,),
                finish_reason="error" if failing else reason if last else None,
                num_prompt_tokens=num_prompt,
                num_output_tokens=i + 1,
                error=self.fail_with if failing else "",
                logprobs=() if logprobs is None else (_logprobs_of(token_id, logprobs),),
                index=index,
                prompt_logprobs=prompt_logprobs if (index, i) == (0, 0) else (),
            )
            if self.lose_token == i + 1 and request_id == self.places[0].request_id:
                continue  # published into a NATS that lost it
            await self._nc.publish(subject, encode_message(event))
            if failing:
                return

    async def wait_for_abort(self, timeout_s: float = 5.0) -> Abort:
        await asyncio.wait_for(self.aborted.wait(), timeout_s)
        return self.aborts[0]


@contextlib.asynccontextmanager
async def router_over(mesh: FakeMesh, **options: Any) -> AsyncIterator[Any]:
    """``mesh`` running and a router over it on a free loopback port, with the RouterConfig
    ``options`` given; yields the running router."""
    from kvmesh.services.router.config import RouterConfig
    from kvmesh.services.router.service import serve_router

    config = RouterConfig(nats_url=mesh.nats_url, host="127.0.0.1", port=0, **options)
    async with mesh.running(), serve_router(config) as running:
        yield running


def _logprobs_of(token_id: int, num_top: int) -> TokenLogprobs:
    """Made-up but well-formed: the token and its neighbours, likeliest first."""
    top = tuple((token_id + i) % 256 for i in range(num_top))
    return TokenLogprobs(-0.5, top, tuple(-0.5 - i for i in range(num_top)))


def _prompt_logprobs(prompt_ids: tuple[int, ...], num_top: int | None) -> tuple[TokenLogprobs, ...]:
    if num_top is None:
        return ()
    return tuple(_logprobs_of(t, num_top) for t in prompt_ids[1:])
