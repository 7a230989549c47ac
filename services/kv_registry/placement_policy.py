"""Which decode worker takes a prompt: the registry's placement policy (pure, clock passed in).

``choose`` skips dead, draining and mismatched workers (another model or KV layout than the
router's ``PlaceRequest.model_spec``, mode, the registry's KV layout, a prompt larger than the
whole pool); keeps the workers with enough estimated free blocks for the whole prompt
(feasibility first); among them takes the highest

    score = prefix_weight * (cached_blocks + store_block_weight * read_blocks)
            - load_weight * load

where ``cached_blocks`` is how many leading blocks of the prompt the worker's prefix cache holds
(``prefix_index``, fed by its KV events; the prompt's hashes are computed as the engine computes
them, shared/kv/prefix_hash.py), ``read_blocks`` how many more leading blocks the kv-store the
worker reads holds (prefix_reach.py says why they weigh less), and ``load`` is running +
waiting + reservations in flight; ties go to the lowest load, then the most free blocks, then
the id. A remote-prefill request placed where at least one block is cached or readable, with at
most ``local_max_suffix_tokens`` left past them, is turned into a local prefill: the decode
worker reads the blocks its cache lacks from the store, computes only that suffix (its engine
takes the cached and read blocks), and no prefill job is sent.

The weights and the workers are the registry's state (core.py: ``RegistryState``); its
``choose`` is this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.services.kv_registry.prefix_reach import prefix_reach, prefix_score
from kvmesh.services.kv_registry.worker_views import DecodeWorkerView
from kvmesh.shared.bus.messages.placement import PlaceRequest
from kvmesh.shared.bus.worker_state import WorkerState

if TYPE_CHECKING:
    from kvmesh.services.kv_registry.core import RegistryState


@dataclass(frozen=True, slots=True)
class Candidate:
    """The worker ``choose`` picked and how many blocks to reserve there; how many leading
    blocks of the prompt its prefix cache holds (and the store it reads), and whether the
    registry turned a remote-prefill request into a local one there (only a short suffix is left
    to compute past the cached and readable blocks)."""

    worker_id: str
    num_blocks: int
    num_cached_blocks: int = 0
    cached_tokens: int = 0
    prefill_here: bool = False
    store_cached_tokens: int = 0  # of the prompt's leading tokens, held by the store it reads
    read_tokens: int = 0  # of them, past its cached ones, that it is expected to read

    def is_local_prefill(self, request: PlaceRequest) -> bool:
        return request.local_prefill or self.prefill_here


@dataclass(frozen=True, slots=True)
class Refusal:
    """No placement: ``retry_after_s > 0`` means overloaded (try later), 0 means do not retry.
    ``reason`` is one word for metrics: no_workers, draining, mismatch or full."""

    error: str
    retry_after_s: float = 0.0
    reason: str = "mismatch"


def choose(
    state: RegistryState,
    request: PlaceRequest,
    now: float,
    exclude: frozenset[str] = frozenset(),
    held_tokens: int = 0,
) -> Candidate | Refusal:
    """Pick a decode worker for ``request`` and count the reservation as in flight there.
    ``held_tokens``: an older placement waiting for room (waiting_line.py) needs this many
    tokens' blocks; ``request`` goes only where that one still fits after it.

    The caller must follow up with ``grant`` or ``release_inflight``."""
    live = [
        w for w in state.decode.values() if state.is_alive(w, now) and w.worker_id not in exclude
    ]
    if not live:
        starting = state.starting(now)
        error = (
            f"decode workers starting (loading their model): {', '.join(starting)}"
            if starting
            else "no live decode workers registered yet"
        )
        return Refusal(error, state.retry_after_s, reason="no_workers")
    eligible, reasons = [], set()
    for w in live:
        reason = _mismatch(w, request, state.kv_spec)
        if reason:
            reasons.add(reason)
        else:
            eligible.append(w)
    if not eligible:
        is_draining = reasons == {"draining"}
        return Refusal(
            f"no decode worker can take this request: {', '.join(sorted(reasons))}",
            state.retry_after_s if is_draining else 0.0,
            reason="draining" if is_draining else "mismatch",
        )
    with_room = [w for w in eligible if w.free_blocks >= blocks_needed(w, len(request.prompt_ids))]
    if with_room and held_tokens:
        with_room = _leaving_room(eligible, with_room, len(request.prompt_ids), held_tokens)
        if not with_room:
            return Refusal(
                "an older request waits for the room this one needs; retry later",
                state.retry_after_s,
                reason="full",
            )
    if not with_room:
        return Refusal(
            "every decode worker is full; retry later", state.retry_after_s, reason="full"
        )
    reach = prefix_reach(
        [w.advert for w in with_room],
        request.prompt_ids,
        state.prefix_index,
        state.stores,
        use_cache=state.prefix_weight > 0,
        use_stores=state.store_block_weight > 0,
        cache_salt=request.sampling.cache_salt,
    )
    best = min(
        with_room,
        key=lambda w: (
            state.load_weight * w.load
            - prefix_score(reach[w.worker_id], state.prefix_weight, state.store_block_weight),
            w.load,
            -w.free_blocks,
            w.worker_id,
        ),
    )
    num_blocks = blocks_needed(best, len(request.prompt_ids))
    best.inflight_blocks += num_blocks
    best.num_inflight += 1
    got = reach[best.worker_id]
    state.prefix_index.touch(best.worker_id, got.own)
    bs = best.advert.reach.block_size
    suffix = len(request.prompt_ids) - got.num_blocks * bs
    prefill_here = (
        not request.local_prefill
        and got.num_blocks > 0
        and best.advert.mode == "disagg"
        and suffix <= state.local_max_suffix_tokens
    )
    return Candidate(
        best.worker_id,
        num_blocks,
        len(got.own),
        len(got.own) * bs,
        prefill_here,
        got.store_blocks * bs,
        got.read_blocks * bs,
    )


def blocks_needed(worker: DecodeWorkerView, num_prompt_tokens: int) -> int:
    return max(1, math.ceil(num_prompt_tokens / worker.advert.reach.block_size))


def _leaving_room(
    eligible: list[DecodeWorkerView],
    with_room: list[DecodeWorkerView],
    num_tokens: int,
    held_tokens: int,
) -> list[DecodeWorkerView]:
    """The workers of ``with_room`` that can take ``num_tokens`` and still leave room for
    ``held_tokens`` somewhere: on themselves, or on another eligible worker."""

    def fits_after(w: DecodeWorkerView, taken: int) -> bool:
        return w.free_blocks - taken >= blocks_needed(w, held_tokens)

    return [
        w
        for w in with_room
        if fits_after(w, blocks_needed(w, num_tokens))
        or any(o is not w and fits_after(o, 0) for o in eligible)
    ]


def _mismatch(worker: DecodeWorkerView, request: PlaceRequest, kv_spec: str) -> str:
    if request.model_spec and worker.advert.reach.model_spec != request.model_spec:
        return (
            f"{worker.worker_id} serves another model or KV layout "
            f"({worker.advert.reach.model_spec or 'none advertised'}; the router's is "
            f"{request.model_spec})"
        )
    if worker.state != WorkerState.READY:
        return "draining"
    if not request.local_prefill and worker.advert.mode != "disagg":
        return "colocated workers take local-prefill requests only"
    if kv_spec and worker.advert.reach.kv_spec != kv_spec:
        return f"KV layout {worker.advert.reach.kv_spec!r} != {kv_spec!r}"
    if blocks_needed(worker, len(request.prompt_ids)) > worker.advert.pool.total_blocks:
        return (
            f"prompt of {len(request.prompt_ids)} tokens exceeds a worker's whole KV pool "
            f"({worker.advert.pool.total_blocks} blocks of {worker.advert.reach.block_size})"
        )
    return ""
