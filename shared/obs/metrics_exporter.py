"""Serve a service's Prometheus metrics over HTTP: ``GET /metrics`` on a port of its own.

Each service keeps its metrics in a ``prometheus_client.CollectorRegistry`` of its own (defined in
its ``metrics.py``; no process-global registry, so tests can run several services in one
process). ``serve_metrics`` is the async context manager that exposes one registry; the router
serves ``exposition`` on its API port instead. Every kvmesh service is a single process, so
prometheus_client's multiprocess mode (for pre-forking servers) is not needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kvmesh.shared.config.service_errors import ServiceStartError
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The body and Content-Type of a scrape of ``registry``: OpenMetrics when the scraper's
    ``Accept`` header asks for it (Prometheus does), else the Prometheus text format."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type


@contextlib.asynccontextmanager
async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int | None
) -> AsyncIterator[int | None]:
    """Serve ``registry`` at ``http://host:port/metrics`` for the duration of the block and yield
    the bound port (``port`` 0: a free one). ``port`` None: no endpoint, yields None."""
    if port is None:
        yield None
        return
    from aiohttp import web  # here: a worker without a metrics port never imports aiohttp

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = exposition(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ServiceStartError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another "
                "--metrics-port (0 picks a free one) or --metrics-host"
            ) from None
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
