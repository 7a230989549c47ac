"""Prefix cache events: decode -> kv-registry.

Block hashes are shared/kv/prefix_hash.py's chain, rooted in the worker's KV layout: the registry
indexes which worker holds which prefix and places requests where their prefix is cached."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message

MAX_CACHE_EVENT_HASHES = 16_384  # per message: a digest of a larger cache sends its newest ones


class KvCacheEvents(Message):
    """Decode -> registry, batched every ``--cache-events-interval-s``: block hashes that entered
    (``stored``) or left (``removed``) the worker's prefix cache since its previous message.
    ``seq`` counts this worker's event and digest messages from 1 (per process, see ``epoch``):
    a registry that sees a gap knows it missed changes and waits for the next digest."""

    worker_id: str
    epoch: str  # the worker's process incarnation: a restarted worker starts a new sequence
    seq: Annotated[int, msgspec.Meta(ge=1)]
    stored: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()
    removed: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()


class KvCacheDigest(Message):
    """Decode -> registry, every ``--cache-digest-interval-s`` and whenever an event batch
    overflowed: the hashes the worker's prefix cache holds now (the newest
    MAX_CACHE_EVENT_HASHES when it holds more). It replaces what the registry knew of the worker;
    events with a higher ``seq`` follow it."""

    worker_id: str
    epoch: str
    seq: Annotated[int, msgspec.Meta(ge=1)]
    hashes: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()
    num_cached_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # all of them, sent or not
