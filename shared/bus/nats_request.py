"""Request/reply: a worker's NATS micro service and its endpoints (each behind the connection's
MessageGuard), and plain-JSON requests (admin)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import nats
import nats.micro
import orjson
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.codec import M, MessageError, decode_message
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, flush_to_server
from kvmesh.shared.obs.metrics_exporter import serve_metrics
from nats.aio.client import Client
from nats.micro.request import Request
from nats.micro.service import Service

if TYPE_CHECKING:
    from kvmesh.shared.config.worker_config import MetricsServiceConfig
    from kvmesh.shared.obs.metric_set import MetricSet

SERVICE_VERSION = "0.1.0"

RequestHandler = Callable[[Request], Awaitable[None]]


async def read_request(req: Request, cls: type[M]) -> M | None:
    """``req``'s body as a ``cls``; a malformed one is answered with a 400 (the codec's error,
    which names the type and the field) and gives None."""
    try:
        return decode_message(req.data, cls)
    except MessageError as exc:
        await req.respond_error("400", str(exc))
        return None


@contextlib.asynccontextmanager
async def micro_service(
    nc: Client,
    *,
    role: str,
    worker_id: str,
    description: str = "",
    metadata: dict[str, str] | None = None,
    stats: Callable[[], Any] | None = None,
) -> AsyncIterator[Service]:
    """Register this worker as NATS micro service ``kvmesh-<role>``: answers $SRV.PING/INFO/STATS
    (``nats micro ls``); metadata carries worker_id and role. Add request/reply endpoints with
    ``open_for_requests``. ``stats``: what $SRV.STATS reports as each endpoint's ``data``
    (JSON-serializable)."""
    meta = {"worker_id": worker_id, "role": role, **(metadata or {})}
    svc = await nats.micro.add_service(
        nc,
        name=f"kvmesh-{role}",
        version=SERVICE_VERSION,
        description=description or f"kvmesh {role} worker {worker_id}",
        metadata=meta,
        **({"stats_handler": lambda _endpoint: stats()} if stats is not None else {}),
    )
    try:
        yield svc
    finally:
        if not nc.is_closed:
            await svc.stop()


@contextlib.asynccontextmanager
async def open_for_requests(
    nc: Client,
    svc: Service,
    *endpoints: tuple[str, str, RequestHandler],
    metrics: MetricSet,
    config: MetricsServiceConfig,
    worker_id: str,
    logger: Any,
    ready: str,
    **log_fields: Any,
) -> AsyncIterator[int | None]:
    """A worker's last start-up step, once its subscriptions and loops run: serve ``metrics`` on
    ``config``'s metrics host and port (``serve_metrics``; the connection's refused messages
    counted in its ``nats_refused``), add the ``(name, subject, handler)`` request/reply
    endpoints to ``svc``, each behind the connection's MessageGuard, flush (the server holds
    every subscription), then log ``ready`` on the service's ``logger`` with the worker id, the
    mesh, ``log_fields`` and the bound metrics port. Yields that port (None: no metrics
    endpoint)."""
    guard = guard_of(nc)
    guard.count_into(metrics.nats_refused)
    async with serve_metrics(
        metrics.registry, config.metrics_host, config.metrics_port
    ) as bound_port:
        for name, subject, handler in endpoints:
            await svc.add_endpoint(name=name, subject=subject, handler=guard.request(handler))
        await flush_to_server(nc)
        logger.info(
            ready,
            worker_id=worker_id,
            mesh=config.subjects.mesh,
            **log_fields,
            metrics_port=bound_port,
        )
        yield bound_port


async def request_json(nc: Client, subject: str, body: dict[str, Any], timeout_s: float) -> Any:
    """Plain-JSON request/reply (admin subjects). Raises NatsUnavailableError on no responders."""
    try:
        msg = await nc.request(subject, orjson.dumps(body), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise NatsUnavailableError(
            f"nobody answers {subject}: is the kv-registry running (`kvmesh serve kv-registry`)?"
        ) from None
    except nats.errors.TimeoutError:
        raise NatsUnavailableError(f"no reply on {subject} within {timeout_s:g}s") from None
    return orjson.loads(msg.data)
