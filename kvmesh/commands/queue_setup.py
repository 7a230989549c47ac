"""Make a mesh's prefill queue as the operator: ``kvmesh up`` at start, ``kvmesh admin
prefill-queue`` for compose and an operator's own server.

No runtime role may create or change the JetStream stream or its consumer (docs/security.md):
the user that does is ``admin``, here, once. The stream is kept on disk, so a NATS server that
restarts with its store still has it; one that lost its store needs this step again (the
prefill-queue keeper says so, and workers wait for it)."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors

from kvmesh.services.prefill_queue.keeper import QueueState, ensure_queue
from kvmesh.shared.bus.nats_auth import NatsAuth
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.prefill_job_stream import JetStreamUnavailableError, PrefillQueueError
from kvmesh.shared.config.nats_options import NatsSecurity
from kvmesh.shared.config.subjects import Subjects

# a cluster's JetStream answers "unavailable" until its members elect a meta leader
JETSTREAM_WAIT_S = 30.0


async def make_prefill_queue(
    nats_url: str,
    mesh: str,
    *,
    auth: NatsAuth | None,
    security: NatsSecurity | None = None,
    jetstream_wait_s: float = JETSTREAM_WAIT_S,
) -> QueueState:
    """Make (or put back, or scale up) mesh ``mesh``'s prefill queue. Raises PrefillQueueError
    in one line a user can act on (no JetStream, or a user without the rights), and
    NatsUnavailableError when NATS cannot be reached."""
    s = Subjects(mesh)
    user = auth.user if auth is not None else "(the connection's credentials)"
    async with connect_nats(nats_url, "kvmesh-queue-setup", auth=auth, security=security) as nc:
        deadline = asyncio.get_running_loop().time() + jetstream_wait_s
        while True:
            try:
                return await ensure_queue(nc, s)
            except JetStreamUnavailableError:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
            except (nats.errors.Error, nats.js.errors.Error) as exc:  # refused: no answer
                raise PrefillQueueError(
                    f"could not make the prefill queue {s.PREFILL_STREAM} as NATS user {user}: "
                    f"{str(exc) or type(exc).__name__}; it needs the admin user (docs/security.md)"
                ) from None
            await asyncio.sleep(0.5)
