"""The router's access log: one line per HTTP request at info (issue 45), as a web server writes
one, with what a generation adds: its tokens and its time to first token.

``access_log_middleware`` times each request from its arrival to the handler's return (a stream's
last event included) and logs ``method``, ``route`` (the route's pattern, e.g.
``/v1/models/{model}``, so ids never become labels), ``status``, ``duration_ms`` and, where the
handler noted them (``note``), ``request_id``, ``prompt_tokens``,
``completion_tokens`` and ``ttft_ms``. A stream's status is the one it is counted under (an error
after the 200 status line is counted as what it was). Scrapes of ``/metrics`` and probes of
``/health`` come every few seconds: they are logged at debug.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)

CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer
QUIET_ROUTES = frozenset({"/metrics", "/health"})  # polled: at debug


@dataclass(slots=True)
class AccessNote:
    """What a handler knows of its request that the HTTP layer does not."""

    request_id: str = ""
    status: int | None = None  # the status counted (a stream's may differ from its status line)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None


_NOTE: contextvars.ContextVar[AccessNote | None] = contextvars.ContextVar(
    "kvmesh_access_note", default=None
)


def note() -> AccessNote:
    """The note of the request this task handles (the middleware made it; outside one, a note
    no one reads); the handler fills it in as it learns."""
    return _NOTE.get() or AccessNote()


def access_fields(
    request: web.Request, seen: AccessNote | None, status: int, duration_s: float
) -> dict[str, str | int | float]:
    """The access line's fields, in the order they print."""
    resource = request.match_info.route.resource
    fields: dict[str, str | int | float] = {
        "method": request.method,
        "route": resource.canonical if resource is not None else request.path,
    }
    fields["status"] = seen.status if seen is not None and seen.status is not None else status
    if seen is not None:
        if seen.request_id:
            fields["request_id"] = seen.request_id
        if seen.prompt_tokens is not None:
            fields["prompt_tokens"] = seen.prompt_tokens
        if seen.completion_tokens is not None:
            fields["completion_tokens"] = seen.completion_tokens
        if seen.ttft_s is not None:
            fields["ttft_ms"] = round(seen.ttft_s * 1000, 1)
    fields["duration_ms"] = round(duration_s * 1000, 1)
    return fields


def access_log_middleware(clock: Callable[[], float] = time.monotonic):
    """The middleware that logs each request's line once its handler is done."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        started = clock()
        status = 500
        seen = AccessNote()
        token = _NOTE.set(seen)
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = CLIENT_CLOSED
            raise
        finally:
            _NOTE.reset(token)
            fields = access_fields(request, seen, status, clock() - started)
            quiet = fields["route"] in QUIET_ROUTES and fields["status"] == 200
            (log.debug if quiet else log.info)("request", **fields)

    return middleware
