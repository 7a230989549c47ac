"""kvmesh router: the OpenAI-compatible HTTP API (SSE streaming) in front of the mesh.

``kvmesh serve router`` builds ``CONFIG`` from flags and KVMESH_* env and calls ``run(config)``;
the shell is service.py (``serve_router``), the HTTP app app.py.
"""

from __future__ import annotations

from kvmesh.services.router.config import RouterConfig

CONFIG = RouterConfig

__all__ = ["CONFIG", "RouterConfig", "run"]


async def run(config: RouterConfig) -> None:
    """Serve until SIGTERM/SIGINT, then stop within ``config.shutdown_grace_s`` (and a moment
    to end what is left; see services/router/shutdown.py)."""
    from kvmesh.services.router.service import run as run_service

    await run_service(config)
