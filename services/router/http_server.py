"""The aiohttp plumbing around the router's handlers (pure HTTP: no mesh).

JSON bodies and error bodies with their status, the middleware that turns every failure into
one (OpenAI's error shape, see errors.py), the API key on /v1 routes, and serving an app on a
port with the connection limits of http_limits.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import msgspec
from aiohttp import web
from kvmesh.services.router.errors import (
    ApiError,
    AuthenticationError,
    InternalError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
)
from kvmesh.services.router.http_limits import AcceptErrorLog, ConnectionTable, GuardedSite
from kvmesh.services.router.tenants import Tenant, Tenants
from kvmesh.shared.config.service_errors import listen_error
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


def error_response(exc: ApiError) -> web.Response:
    return json_response(exc.body(), status=exc.status, headers=exc.headers())


def json_response(
    payload: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload),
        status=status,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPNotFound:
        return error_response(
            RouteNotFoundError(f"no route {request.method} {request.path}; see /openapi.json")
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(
            PayloadTooLargeError(
                f"the request body is larger than this router accepts ({exc.text}); raise "
                "--max-body-mb or send less"
            )
        )
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(
            MethodNotAllowedError(
                f"{request.method} is not allowed on {request.path}; use {allowed}"
            )
        )
    except (asyncio.CancelledError, ConnectionError, web.HTTPException):
        raise
    except Exception:
        log.exception("unhandled error", path=request.path)
        return error_response(InternalError("internal error in the router; see its log"))


TENANT = web.RequestKey("tenant", Tenant)


def tenant_of(request: web.Request) -> Tenant:
    """The caller of a /v1 route, as ``api_key_middleware`` identified it."""
    tenant = request.get(TENANT)
    assert tenant is not None, "api_key_middleware identifies every /v1 caller"
    return tenant


def api_key_middleware(tenants: Tenants | str | None):
    """With API keys, every /v1 route needs ``Authorization: Bearer <key>`` of one of them
    (health, metrics and the OpenAPI document stay open, as in vLLM); the caller's ``Tenant``
    is then ``request["tenant"]`` (``tenant_of``). A single key may be given as a string."""
    if not isinstance(tenants, Tenants):
        tenants = Tenants([tenants] if tenants else [])

    @web.middleware
    async def check_api_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            tenant = tenants.identify(request.headers.get("Authorization", ""))
            if tenant is None:
                raise AuthenticationError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with a key "
                    "the router was started with (--api-key / KVMESH_API_KEY, --api-keys, "
                    "--api-keys-file)"
                )
            request[TENANT] = tenant
        return await handler(request)

    return check_api_key


@asynccontextmanager
async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    connections: ConnectionTable,
    *,
    reuse_port: bool = False,
) -> AsyncIterator[int]:
    """Serve ``app`` on host:port for the duration of the block; yields the bound port. Each
    connection goes through ``connections``' limits (services/router/http_limits.py);
    ``reuse_port``: SO_REUSEPORT, several routers on one port.

    Handlers are cancelled when their client disconnects, so a waiting request aborts its work
    on the mesh instead of running to the end for nobody."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    accept_errors = AcceptErrorLog(connections.on_refused)
    loop = asyncio.get_running_loop()
    accept_errors.install(loop)
    try:
        site = GuardedSite(runner, host, port, connections, reuse_port=reuse_port)
        try:
            await site.start()
        except OSError as exc:  # a busy port, a foreign address: one line says what to change
            raise listen_error(host, port, exc) from None
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
        accept_errors.uninstall(loop)
