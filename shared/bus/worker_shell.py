"""A worker's start-up on NATS, the same steps in the same order for every service.

Each service shell (decode, prefill, draft, kv-store, kv-registry) says what it shows with one
``WorkerShell`` and enters ``serve_worker``. Who the worker is (its role and id, as its heartbeats
say), its config and its metrics are its service object's (``ShellService``): said once there,
not again in the shell. The steps:

1. presence: the micro service (``$SRV``), heartbeats (from a thread of their own:
   shared/bus/liveness.py), the log-level control;
2. its subscriptions (each through the MessageGuard);
3. its own contexts (a task group, a queue consumer, solicited store adverts);
4. its loops;
5. its request endpoints (and ``control``, which applies ``kvmesh admin drain|resume``) and
   /metrics: from here on it answers, and logs ``ready``;
6. what may start only once it answers (its adverts: a peer that saw one finds the endpoints).

On exit the steps close in reverse order.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.shared.bus.nats_request import RequestHandler, open_for_requests
from kvmesh.shared.bus.nats_subscribe import Handler, subscriptions
from kvmesh.shared.bus.service_lifetime import background
from kvmesh.shared.bus.worker_presence import (
    answer_worker_control,
    read_worker_control,
    worker_presence,
)
from kvmesh.shared.config.subjects import Subjects
from nats.aio.client import Client
from nats.micro.request import Request

if TYPE_CHECKING:
    from kvmesh.shared.bus.messages.workers import WorkerHeartbeat
    from kvmesh.shared.config.worker_config import MetricsServiceConfig
    from kvmesh.shared.obs.metric_set import MetricSet

Loop = Callable[[], Coroutine[Any, Any, Any]]
Control = Callable[[str], Awaitable[None]]


class ShellService(Protocol):
    """A worker's service object, as its shell needs it: ``role`` and ``worker_id`` (those of
    its heartbeats), its config (heartbeat interval, stall limit, metrics port), the metrics
    its /metrics serves, and ``heartbeat``, the heartbeat it sends now."""

    role: str
    worker_id: str
    config: MetricsServiceConfig
    metrics: MetricSet

    def heartbeat(self) -> WorkerHeartbeat: ...


@dataclass(frozen=True, slots=True)
class WorkerShell:
    """What one worker shows on NATS. ``service``: who it is, its config, metrics and
    heartbeat; ``ready``: the line logged once it answers; ``endpoints``: (name, subject,
    handler) request endpoints of its micro service; ``routes``: (subject, message type,
    handler) subscriptions; ``loops`` and ``after_ready``: task bodies, called when their step
    starts; ``control``: applies an action of ``kvmesh admin``, "drain" or "resume" (the
    ``control`` endpoint, see ``control_endpoint``); ``ready_fields``: logged with the ready
    line."""

    service: ShellService
    ready: str
    endpoints: Sequence[tuple[str, str, RequestHandler]] = ()
    routes: Sequence[tuple[str, type[Any], Handler]] = ()
    contexts: Sequence[AbstractAsyncContextManager[Any]] = ()
    loops: Sequence[Loop] = ()
    after_ready: Sequence[Loop] = ()
    metadata: dict[str, str] | None = None
    stats: Callable[[], Any] | None = None
    ready_fields: Mapping[str, Any] = field(default_factory=dict)
    control: Control | None = None


def control_endpoint(
    nc: Client,
    subjects: Subjects,
    worker_id: str,
    heartbeat: Callable[[], WorkerHeartbeat],
    control: Control,
) -> tuple[str, str, RequestHandler]:
    """The ``control`` endpoint on ``worker_control(id)``: a malformed WorkerControl is answered
    400 and changes nothing; else ``control`` applies the action, and the worker's new heartbeat
    is announced on its heartbeat subject, then is the answer (answer_worker_control)."""

    async def on_control(req: Request) -> None:
        action = await read_worker_control(req)
        if action is None:
            return
        await control(action)
        await answer_worker_control(nc, subjects, req, heartbeat())

    return ("control", subjects.worker_control(worker_id), on_control)


@contextlib.asynccontextmanager
async def serve_worker(
    nc: Client, subjects: Subjects, shell: WorkerShell, logger: Any
) -> AsyncIterator[int | None]:
    """Run ``shell``'s steps (module docstring) for the duration of the block; yields the
    metrics port (None: no metrics server)."""
    service = shell.service
    async with contextlib.AsyncExitStack() as stack:
        svc = await stack.enter_async_context(
            worker_presence(
                nc,
                subjects,
                role=service.role,
                worker_id=service.worker_id,
                heartbeat=service.heartbeat,
                interval_s=service.config.heartbeat_s,
                stall_limit_s=service.config.stall_limit_s,
                metadata=shell.metadata,
                stats=shell.stats,
            )
        )
        await stack.enter_async_context(subscriptions(nc, *shell.routes))
        for context in shell.contexts:
            await stack.enter_async_context(context)
        if shell.loops:
            await stack.enter_async_context(background(*(loop() for loop in shell.loops)))
        endpoints = list(shell.endpoints)
        if shell.control is not None:
            endpoints.append(
                control_endpoint(nc, subjects, service.worker_id, service.heartbeat, shell.control)
            )
        port = await stack.enter_async_context(
            open_for_requests(
                nc,
                svc,
                *endpoints,
                metrics=service.metrics,
                config=service.config,
                logger=logger,
                ready=shell.ready,
                worker_id=service.worker_id,
                **shell.ready_fields,
            )
        )
        if shell.after_ready:
            await stack.enter_async_context(background(*(loop() for loop in shell.after_ready)))
        yield port
