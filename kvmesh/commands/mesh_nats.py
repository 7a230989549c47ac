"""The NATS a ``kvmesh up`` mesh runs on: which URL, the server it starts or the one it joins,
and the prefill queue made there before any role connects.

Left at the default URL, a mesh does not join the nats-server another ``kvmesh up`` started for
its own mesh: it takes a free port of its own (``default_nats_url``). Where nothing answers, it
starts a nats-server with one user per role (``start_nats``; the admin's password in a file
beside the server's store, for ``kvmesh admin``). Where a server answers, it joins only with
credentials and where who runs the server is known (shared/bus/nats_vetting.py), and not when
its mesh already runs there (``join_nats``). The prefill queue is made as admin (``make_queue``;
docs/security.md). Every refusal is a ``LaunchError`` saying what to do instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.commands.launch_error import LaunchError
from kvmesh.commands.up_config import UpConfig
from kvmesh.shared.bus.mesh_state import running_meshes
from kvmesh.shared.bus.nats_auth import (
    ADMIN,
    PASSWORD_FILE_ENV,
    USER_ENV,
    MeshCredentials,
    NatsAuth,
)
from kvmesh.shared.config.nats_options import NatsSecurity, redact_url, url_has_credentials
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.service_config import DEFAULT_NATS_URL
from kvmesh.shared.config.subjects import Subjects

if TYPE_CHECKING:
    from kvmesh.shared.bus.nats_server import NatsServer


@dataclass(frozen=True, slots=True)
class StartedNats:
    """A nats-server started for one mesh: its users (one per role) and the admin's password
    file (mode 0600)."""

    server: NatsServer
    credentials: MeshCredentials
    admin: NatsAuth
    admin_password_file: Path


def default_nats_url(mesh: str) -> str:
    """The NATS URL of a launcher left at the default: the default, unless the server there
    belongs to another ``kvmesh up``'s mesh, then a free port of our own. The same mesh
    already up on this machine is refused."""
    meshes = running_meshes()
    same = [m for m in meshes if m.mesh == mesh]
    if same:
        other = same[0]
        raise LaunchError(
            f"mesh {mesh!r} is already up on this machine (kvmesh up pid {other.pid}, "
            f"{other.router_url}, NATS {other.nats_url}); give this one another --mesh, or "
            "stop that one first"
        )
    owner = next((m for m in meshes if m.nats_url == DEFAULT_NATS_URL), None)
    if owner is None:
        return DEFAULT_NATS_URL
    url = f"nats://127.0.0.1:{free_port()}"
    print(
        f"kvmesh up: {DEFAULT_NATS_URL} is the nats-server of mesh {owner.mesh!r} (kvmesh up "
        f"pid {owner.pid}); mesh {mesh!r} gets its own at {url} (kvmesh admin "
        f"--mesh {mesh} finds it)",
        file=sys.stderr,
    )
    return url


def start_nats(url: str, mesh: str, subjects: Subjects) -> StartedNats:
    """Start a nats-server at ``url`` (a plain nats://HOST:PORT) for ``mesh``, one user per
    role, and write the admin's password file."""
    from kvmesh.shared.bus.nats_server import NatsServer, parse_nats_url

    if not url.startswith("nats://") or url_has_credentials(url):
        raise LaunchError(
            f"nothing answers at {redact_url(url)}, and kvmesh up starts a nats-server only "
            "for a plain nats://HOST:PORT URL (credentials and TLS are the operator's "
            "server's); start that server first, or give a nats:// URL"
        )
    host, nats_port = parse_nats_url(url)
    credentials = MeshCredentials.generate()
    server = NatsServer(nats_port, host=host, authorization=credentials.server_config(subjects))
    server.start()
    admin = credentials.auth(ADMIN)
    password_file = server.state_dir / "admin.password"
    fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(admin.password)
    print(
        f"kvmesh up: started nats-server at {server.url} for mesh {mesh!r}, one "
        f"user per role; for kvmesh admin: export {USER_ENV}={ADMIN} "
        f"{PASSWORD_FILE_ENV}={password_file} (kvmesh admin --mesh {mesh} "
        "finds both by itself)",
        file=sys.stderr,
    )
    return StartedNats(server, credentials, admin, password_file)


def join_nats(url: str, config: UpConfig, auth: NatsAuth | None) -> None:
    """Join the NATS at ``url`` only with credentials, only where who runs it is known, and
    not when ``config``'s mesh already runs there; ``auth``: this process's own user."""
    from kvmesh.shared.bus.nats_vetting import NatsVettingError, vet_nats_url

    security = config.nats_security
    try:
        vet_nats_url(
            url,
            insecure=config.nats_insecure,
            has_credentials=bool(auth or url_has_credentials(url) or security.creds),
            tls=security.uses_tls,
            trust_network=security.trust_network,
        )
    except NatsVettingError as exc:
        raise LaunchError(str(exc)) from None
    assert config.mesh is not None
    check_mesh_absent(url, config.mesh, auth, security)


def check_mesh_absent(
    url: str, mesh: str, auth: NatsAuth | None, security: NatsSecurity | None = None
) -> None:
    """Refuse the NATS at ``url`` if ``mesh`` already runs there: its workers would count as
    ours, and ours would take its requests. Other meshes there are no concern."""
    from kvmesh.shared.bus.nats_connect import NatsUnavailableError

    try:
        others = _run_sync(workers_on(url, auth=auth, mesh=mesh, security=security))
    except NatsUnavailableError as exc:  # e.g. a server of another mesh, with its own users
        raise LaunchError(
            f"cannot join the NATS server at {redact_url(url)}: {exc}; or give this mesh a "
            "nats-server of its own: --nats-url nats://127.0.0.1:PORT with a free PORT"
        ) from None
    if others:
        raise LaunchError(
            f"mesh {mesh!r} is already running on {redact_url(url)} (workers: "
            f"{', '.join(sorted(others)[:6])}{', ...' if len(others) > 6 else ''}); start "
            f"this one as another mesh (--mesh NAME), or on its own NATS (e.g. --nats-url "
            "nats://127.0.0.1:4223; it is started here if nothing answers), or stop the "
            "other one first"
        )


def make_queue(nats_url: str, mesh: str, auth: NatsAuth | None, security: NatsSecurity) -> None:
    """Make the mesh's prefill queue (queue_setup.py) as admin, before any role connects."""
    from kvmesh.commands.queue_setup import make_prefill_queue
    from kvmesh.shared.bus.nats_connect import NatsUnavailableError
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

    try:
        _run_sync(make_prefill_queue(nats_url, mesh, auth=auth, security=security))
    except (PrefillQueueError, NatsUnavailableError) as exc:
        raise LaunchError(f"{exc} (or make it first: kvmesh admin prefill-queue)") from None


async def workers_on(
    nats_url: str,
    listen_s: float = 1.2,
    auth: NatsAuth | None = None,
    *,
    mesh: str,
    security: NatsSecurity | None = None,
) -> set[str]:
    """Worker ids of mesh ``mesh`` heard on ``nats_url``: its registry's list, or heartbeats
    for ``listen_s``."""
    from kvmesh.shared.bus.admin_client import AdminError, admin_client
    from kvmesh.shared.bus.messages.codec import MessageError, decode_message
    from kvmesh.shared.bus.messages.workers import WorkerHeartbeat

    async with admin_client(
        nats_url, timeout_s=2.0, auth=auth, mesh=mesh, security=security
    ) as admin:
        try:
            return {w.worker_id for w in await admin.workers()}
        except AdminError:  # no registry: listen for heartbeats instead
            pass
        heard: set[str] = set()

        async def on_beat(msg) -> None:
            with contextlib.suppress(MessageError):
                heard.add(decode_message(msg.data, WorkerHeartbeat).worker_id)

        sub = await admin.nc.subscribe(admin.subjects.HEARTBEAT_ALL, cb=on_beat)
        await asyncio.sleep(listen_s)
        await sub.unsubscribe()
        return heard


def _run_sync(coro):
    """Run a coroutine to completion from sync code, also when called inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
