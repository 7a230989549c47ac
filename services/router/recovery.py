"""What a request does when the mesh cannot serve it now (pure: no NATS; times passed in).

A full mesh, or a kv-registry restarting, is waited for within the request's first-token
deadline, asking again with jittered backoff; a missing part of the mesh is a 503 at once. A
placement nobody answered is asked again of the next registry. ``dispatch.py`` does the I/O and
asks here which error, which wait and which abort reason; ``attempts.py`` decides retry or
migration.
"""

from __future__ import annotations

import random

from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import (
    ApiError,
    ClientGoneError,
    GatewayTimeoutError,
    MeshError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared.bus.messages.placement import PlaceReply
from kvmesh.shared.config.subjects import Subjects

# A kv-registry heard this recently and not answering now is restarting (its supervisor brings it
# back in seconds): placements wait for it, within the request's first-token deadline, instead
# of failing. One never heard, or gone longer, is missing: a 503 at once.
REGISTRY_RESTART_S = 20.0

# The same for decode workers: with none alive, one heard this recently (or one that heartbeats
# "starting", loading its model) may be coming back, as `kvmesh up` restarts a dead one under
# its id: placements and migrations wait for it, within the request's deadline, instead of a
# 503 at once. With none heard for this long, "no decode worker is alive" is a 503 at once.
DECODE_RESTART_S = 20.0

# What was published while the router's NATS connection was down is lost to it: its tokens, and
# perhaps its prefill job (a restarted server may come back with an empty JetStream store). A
# request that hears nothing for this long after a reconnect runs again: from the start before
# its first token, else it migrates. A lost token among ones that do arrive shows as a gap in
# the events' token counts, and the stream migrates at once.
RECONNECT_SILENCE_S = 1.0


class PlacementLostError(GatewayTimeoutError):
    """No answer to a placement within --place-timeout-s: the registry died or was cut off
    holding it. It is asked again (of the next registry) within the request's deadline."""


def prefills_locally(
    config: RouterConfig, num_prompt_tokens: int, prefill_pool: WorkerPool | None, now: float
) -> bool:
    """Whether the decode worker prefills the prompt itself (no prefill job): colocated, a short
    prompt, or no prefill worker ready (rather than the job waiting in the queue)."""
    if config.mode == "colocated":
        return True
    if num_prompt_tokens < config.local_prefill_threshold:
        return True
    pool = prefill_pool
    return pool is not None and pool.is_known(now) and pool.num_ready(now) == 0


def stop_waiting_for_room(
    exc: OverloadedError,
    *,
    no_decode_alive: bool,
    left_s: float,
    request_id: str,
    first_token_timeout_s: float,
) -> ApiError | None:
    """Overload is queueing: an accepted request the mesh has no room for (``exc``) waits for
    room, it does not fail. The error that ends the wait instead (None: wait): no decode worker
    alive at all, nor any heard within DECODE_RESTART_S ("no workers" is not "at capacity"; see
    ``no_decode_worker``), or too little of the first-token deadline left (``left_s``) for the
    wait the registry asks."""
    if no_decode_alive:
        return ServiceUnavailableError(
            "no decode worker is alive (none heartbeats); start one (`kvmesh "
            "serve decode`) or check the mesh with `kvmesh admin workers`",
            retry_after_s=exc.retry_after_s or 1.0,
        )
    if left_s <= exc.retry_after_s:
        return GatewayTimeoutError(
            f"the mesh had no room for request {request_id} within "
            f"{first_token_timeout_s:g}s (--first-token-timeout-s); "
            f"last answer: {exc.message}"
        )
    return None


def no_decode_worker(pool: WorkerPool | None, now: float) -> bool:
    """Whether the mesh has no decode worker to wait for: the router has listened long enough,
    none heartbeats (a "starting" one does), and none was heard within DECODE_RESTART_S (a dead
    one being restarted is waited for)."""
    return (
        pool is not None
        and pool.is_known(now)
        and pool.num_alive(now) == 0
        and not pool.seen_within(now, DECODE_RESTART_S)
    )


def room_backoff_s(retry_after_s: float) -> float:
    """How long to wait before asking for room again: the registry's hint, at most 0.5 s,
    jittered (x0.5 to x1.5) so that waiting requests do not ask in step."""
    return min(retry_after_s, 0.5) * (0.5 + random.random())


def registry_silent_error(seen_recently: bool, subjects: Subjects) -> ApiError:
    """No kv-registry answers a placement: one ``seen_recently`` (within REGISTRY_RESTART_S) is
    restarting, so it is waited for as for room; else none runs (or the mesh is misnamed)."""
    if seen_recently:
        return OverloadedError("the kv-registry is not answering (restarting?)", retry_after_s=0.5)
    return ServiceUnavailableError(
        f"no kv-registry answers on {subjects.REGISTRY_PLACE}; start one for mesh "
        f"{subjects.mesh} (`kvmesh serve kv-registry --mesh "
        f"{subjects.mesh}`) or check --nats-url"
    )


def placement_refused_error(reply: PlaceReply) -> ApiError:
    """The kv-registry refused a placement (``reply``, not ok): at capacity is waited for as
    room; anything else is a 503."""
    if reply.retry_after_s > 0:
        return OverloadedError(
            f"the mesh is at capacity ({reply.error or 'no free KV blocks'}); "
            f"retry after {reply.retry_after_s:g}s",
            retry_after_s=reply.retry_after_s,
        )
    return ServiceUnavailableError(
        f"the kv-registry could not place the request: {reply.error or 'no reason given'}"
    )


def token_deadline(
    num_events: int, first_deadline: float, last_event_at: float, config: RouterConfig
) -> tuple[float, str]:
    """When the next token event is due (the first within --first-token-timeout-s of the
    request's start, each next one within --token-timeout-s of the last), and what is awaited,
    for the timeout's message."""
    if num_events == 0:
        return first_deadline, f"the first token within {config.first_token_timeout_s:g}s"
    return (
        last_event_at + config.token_timeout_s,
        f"a next token within {config.token_timeout_s:g}s",
    )


def abort_reason(exc: BaseException) -> str:
    """The reason an Abort gives when the request's block is left by ``exc``."""
    if isinstance(exc, ClientGoneError):
        return exc.reason
    if isinstance(exc, ConnectionError):
        return "client disconnected"
    if isinstance(exc, MeshError):
        return "mesh error"
    return "router error"
