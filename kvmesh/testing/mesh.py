"""The harness the end-to-end tests and the mesh benchmarks share: a real mesh on this machine.

``local_mesh`` (a mesh in child processes, extra service settings through KVMESH_* env),
``mesh_config`` / ``launched`` / ``start_launcher`` (an UpConfig of a test mesh, ``kvmesh up``'s
Launcher started and stopped around a block), ``MeshTap`` (what flows on the request subjects),
``complete`` (one HTTP completion), ``wait_blocks_returned`` (admin status until every decode
worker's free_blocks is back to total_blocks) and ``random_prompts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO

from kvmesh.shared.config.subjects import DEFAULT_MESH

if TYPE_CHECKING:
    from kvmesh.shared.bus.messages.admin import DecodeStatusRow

MODEL = "kvmesh-tiny"


@contextlib.contextmanager
def local_mesh(
    mode: str = "disagg",
    transport: str = "auto",
    *,
    model: str = MODEL,
    nats_url: str | None = None,
    env: Mapping[str, str] | None = None,
    local_prefill_threshold: int = 0,
    decode_pacing_ms: float = 0.0,
    prefill: int | None = None,
    decode: int = 1,
    prefill_nice: int | None = None,
    cpu_sharing: str | None = None,
    log_level: str = "warning",
    startup_timeout_s: float = 180.0,
    nats_insecure: bool = False,
) -> Iterator[Any]:
    """A whole mesh on a fresh nats-server, in child processes; yields the Launcher (``.url``,
        ``.config.nats_url``). ``env`` (KVMESH_* settings, e.g. KVMESH_CHUNK_TOKENS) reaches every
        service; ``model`` is kvmesh-tiny or a checkpoint directory; ``nats_url``: a NATS server to use
    (default: a fresh one, started with one user per role; one that asks for no credentials
    needs ``nats_insecure``: `kvmesh up --nats-insecure`); ``prefill``, ``prefill_nice`` and
    ``cpu_sharing`` left at None are ``kvmesh up``'s defaults. Synchronous: use it from sync
    fixtures or scripts, not inside an event loop."""
    chosen = {
        name: value
        for name, value in (
            ("prefill", prefill),
            ("prefill_nice", prefill_nice),
            ("cpu_sharing", cpu_sharing),
        )
        if value is not None
    }
    if nats_url is not None:
        chosen["nats_url"] = nats_url
    config = mesh_config(
        model=model,
        mode=mode,
        transport=transport,
        local_prefill_threshold=local_prefill_threshold,
        decode_pacing_ms=decode_pacing_ms,
        decode=decode,
        log_level=log_level,
        startup_timeout_s=startup_timeout_s,
        nats_insecure=nats_insecure,
        **chosen,
    )
    with launched(config, env) as launcher:
        yield launcher


def mesh_config(**fields: Any) -> Any:
    """An UpConfig for a mesh of tests or benchmarks: kvmesh-tiny, a nats-server of its own on a
    free port, any free HTTP port, warnings only, 180 s to start and 10 s to stop; ``fields`` set
    these or any other of its fields."""
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.shared.config.ports import free_port

    defaults = {
        "model": MODEL,
        "port": 0,
        "log_level": "warning",
        "startup_timeout_s": 180.0,
        "stop_timeout_s": 10.0,
    }
    if "nats_url" not in fields:
        defaults["nats_url"] = f"nats://127.0.0.1:{free_port()}"
    return UpConfig(**{**defaults, **fields})


@contextlib.contextmanager
def launched(
    config: Any, env: Mapping[str, str] | None = None, log: BinaryIO | None = None
) -> Iterator[Any]:
    """Start ``kvmesh up``'s Launcher for ``config`` (an UpConfig) with ``env`` set only while its
    children start (they inherit it), wait until the mesh is ready, yield it, stop it on exit.
    ``log``: where the services' output goes (None: this process's stderr)."""
    launcher = start_launcher(config, env, log)
    try:
        asyncio.run(launcher.wait_ready())
        yield launcher
    finally:
        launcher.stop()


def start_launcher(
    config: Any, env: Mapping[str, str] | None = None, log: BinaryIO | None = None
) -> Any:
    """``kvmesh up``'s Launcher for ``config``, its children started with ``env`` added to this
    process's environment (set only while they start: they inherit it); not waited for."""
    from kvmesh.commands.launcher import Launcher

    launcher = Launcher(config, log)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        launcher.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return launcher


class MeshTap:
    """Listens on every request's subjects: TokenEvents, PrefillStarteds, PrefillReports,
    PrefillDones."""

    def __init__(self, nats_url: str, auth: Any = None, *, mesh: str = DEFAULT_MESH) -> None:
        self.nats_url = nats_url
        self.auth = auth  # a NatsAuth (the mesh's admin user), or None: the environment's
        self.mesh = mesh
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, Any] = {}  # request id -> final TokenEvent
        self.reports: dict[str, Any] = {}  # request id -> PrefillReport
        self.prefill_done: dict[str, Any] = {}  # request id -> PrefillDone
        self.started: dict[str, Any] = {}  # request id -> PrefillStarted (a worker took its job)
        self._any_started = asyncio.Event()
        self._events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._answered: dict[str, asyncio.Event] = defaultdict(asyncio.Event)  # by reply id

    async def __aenter__(self) -> MeshTap:
        from kvmesh.shared.bus.messages.codec import decode_message
        from kvmesh.shared.bus.messages.prefill_jobs import (
            PrefillDone,
            PrefillReport,
            PrefillStarted,
        )
        from kvmesh.shared.bus.messages.token_streams import TokenEvent
        from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
        from kvmesh.shared.config.subjects import Subjects

        self._stack = contextlib.AsyncExitStack()
        from kvmesh.shared.bus.wire_ids import attempt_of  # the router's wire ids

        nc = await self._stack.enter_async_context(
            connect_nats(self.nats_url, "mesh-tap", auth=self.auth)
        )

        async def on_tokens(msg: Any) -> None:
            event = decode_message(msg.data, TokenEvent)
            self.tokens[event.request_id] += event.token_ids
            if event.finish_reason is not None:
                self.finished[event.request_id] = event
                self._events[event.request_id].set()
                self._answered[attempt_of(event.request_id)[0]].set()

        async def on_report(msg: Any) -> None:
            report = decode_message(msg.data, PrefillReport)
            self.reports[report.request_id] = report

        async def on_started(msg: Any) -> None:
            started = decode_message(msg.data, PrefillStarted)
            self.started[started.request_id] = started
            self._any_started.set()

        async def on_done(msg: Any) -> None:
            done = decode_message(msg.data, PrefillDone)
            self.prefill_done[done.request_id] = done

        s = Subjects(self.mesh)
        await nc.subscribe(s.request_tokens("*"), cb=on_tokens)
        await nc.subscribe(s.request_prefill_report("*"), cb=on_report)
        await nc.subscribe(s.request_prefill_started("*"), cb=on_started)
        await nc.subscribe(s.decode_prefill_done("*"), cb=on_done)
        await flush_to_server(nc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def wait_finished(self, request_id: str, timeout_s: float = 30.0) -> Any:
        """The final TokenEvent of the wire id ``request_id`` (one attempt), once it comes."""
        await asyncio.wait_for(self._events[request_id].wait(), timeout_s)
        return self.finished[request_id]

    async def wait_started(self, timeout_s: float = 30.0) -> Any:
        """The first PrefillStarted heard (a prefill worker announced it took a job, before it
        runs it), once one comes."""
        await asyncio.wait_for(self._any_started.wait(), timeout_s)
        return next(iter(self.started.values()))

    def attempts(self, reply_id: str) -> list[str]:
        """The wire ids heard of the request the router answered as ``reply_id``, in attempt
        order: the reply id, then its retries (``-rN``, before a first token) and migrations
        (``-mN``, the rest of the stream on another decode worker)."""
        from kvmesh.shared.bus.wire_ids import attempt_of

        ids = {*self.tokens, *self.finished}
        mine = [w for w in ids if attempt_of(w)[0] == reply_id]
        return sorted(mine, key=lambda w: attempt_of(w)[1])

    async def wait_answered(self, reply_id: str, timeout_s: float = 30.0) -> tuple[Any, list[int]]:
        """The final TokenEvent of the request answered as ``reply_id`` and all its tokens, once
        its last attempt finished (``answer``): the router retries and migrates under new wire
        ids, so a reply's stream may end on one of those rather than on its own id. For a
        request the router answered with its tokens (a 200)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (answer := self.answer(reply_id)) is None:
            answered = self._answered[reply_id]
            answered.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no finish heard for {reply_id}: {self.attempts(reply_id)}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answered.wait(), min(left, 0.5))
        return answer

    def answer(self, reply_id: str) -> tuple[Any, list[int]] | None:
        """``wait_answered``'s result if the last attempt heard of ``reply_id`` has finished as
        an answered request does ("stop" or "length"): an attempt the router gave up ends in
        "abort" or "error", and the next attempt's first event may come after that."""
        attempts = self.attempts(reply_id)
        if not attempts or attempts[-1] not in self.finished:
            return None
        if self.finished[attempts[-1]].finish_reason not in ("stop", "length"):
            return None
        return self.finished[attempts[-1]], [t for w in attempts for t in self.tokens[w]]


def completion_body(prompt_ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The body of a greedy /v1/completions request of kvmesh-tiny with a token-id prompt;
    ``extra``: more fields (``ignore_eos``, ``stream``, ...) or other values."""
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0}
    return {**body, **extra}


async def complete(
    session: Any, url: str, prompt_ids: list[int], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """One greedy /v1/completions request with a token-id prompt; returns the JSON body."""
    body = completion_body(prompt_ids, max_tokens, **extra)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        payload = await resp.json()
        if resp.status != 200:
            raise AssertionError(f"HTTP {resp.status}: {payload}")
        return payload


async def wait_blocks_returned(
    nats_url: str,
    auth: Any = None,
    timeout_s: float = 15.0,
    *,
    mesh: str = DEFAULT_MESH,
    workers: int | None = None,
) -> tuple[DecodeStatusRow, ...]:
    """Admin status rows of the decode workers, once each has every block free again and, with
    ``workers``, that many are registered (a registry that was cut off relearns the workers from
    their next heartbeat); or the last rows seen when ``timeout_s`` runs out: the caller asserts.
    A registry that does not answer (being restarted) is asked again until then."""
    from kvmesh.shared.bus.admin_client import AdminError, admin_client

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with admin_client(nats_url, auth=auth, mesh=mesh) as admin:
        while True:
            try:
                rows = (await admin.status()).decode
            except AdminError:  # the kv-registry is being restarted: ask again until the deadline
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)
                continue
            complete = workers is None or len(rows) == workers
            if rows and complete and all(r.pool.free_blocks == r.pool.total_blocks for r in rows):
                return rows
            if loop.time() > deadline:
                return rows
            await asyncio.sleep(0.2)


def random_prompts(num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]
