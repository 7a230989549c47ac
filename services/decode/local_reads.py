"""Local prefills that read their prompt's prefix from a kv-store before they are queued.

A feature of the decode worker (shared/bus/worker_feature.py; ``--use-kv-store``, composed in
compose.py over the worker's kv-store link): for a local-prefill request the worker accepted
while a store is known, it reads the prefix blocks the worker's own cache lacks. When the read
ends, well or not (best effort: what was not read is computed), it wakes the worker's loop (the
``wake`` event the composition gives both) and the worker's next ``admit()`` takes the request
(``take_ended``) and adopts its blocks into the prefix cache, between steps. A request aborted
while its read runs, or after it ended but before it was taken, has its blocks adopted (they
verified) and then left to the cache's eviction. Its adverts say the worker reads a kv-store
(``reads_kv_store``: placement counts what the store holds as within its reach).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvmesh.shared.bus.worker_feature import Feature
from kvmesh.shared.mesh.kv_store_prefix import Fetched, PoolIo, PrefixReader
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions

if TYPE_CHECKING:
    from kvmesh.services.decode.compose import DecodeParts

log = logs.get_logger(__name__)


class LocalPrefixReads(Feature):
    def __init__(self, reader: PrefixReader, lock: asyncio.Lock, wake: asyncio.Event) -> None:
        """``lock``: the engine's (a read adopts nothing, but pins what it reuses under it);
        ``wake``: the worker's loop's (set when a read ended: there is something for
        ``admit()``)."""
        self.reader = reader
        self._lock = lock
        self._wake = wake
        self._reading: dict[str, tuple[list[int], asyncio.Task[None]]] = {}
        self._aborted: set[str] = set()  # aborted while reading
        # read (well or not), not taken yet: their prompts and options
        self._ended: dict[str, tuple[list[int], SamplingOptions]] = {}
        self._read: dict[str, Fetched] = {}  # read, the request queued: adopted by admit()
        self._unused: list[Fetched] = []  # reads of aborted requests: adopted, then freed

    @classmethod
    def compose(cls, parts: DecodeParts) -> LocalPrefixReads | None:
        link = parts.store_link()
        if link is None:
            return None
        engine = parts.engine
        reader = PrefixReader(PoolIo.of(link.client, engine.kv_spec, engine), link.stores)
        return cls(reader, parts.lock, parts.wake)

    def advert(self) -> Mapping[str, Any]:
        return {"reads_kv_store": True}

    @property
    def can_read(self) -> bool:
        """A kv-store is known to read from."""
        return self.reader.stores.target() is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reading or request_id in self._ended

    def __len__(self) -> int:
        """Requests held: reads in flight, and ended ones not taken yet."""
        return len(self._reading) + len(self._ended)

    @property
    def has_unused(self) -> bool:
        return bool(self._unused)

    def start(self, rid: str, prompt: list[int], params: SamplingOptions) -> None:
        task = asyncio.ensure_future(self._read_prefix(rid, prompt, params))
        self._reading[rid] = (prompt, task)

    async def _read_prefix(self, rid: str, prompt: list[int], params: SamplingOptions) -> None:
        fetched = None
        try:
            fetched = await self.reader.fetch(prompt, self._lock, params.cache_salt)
        except Exception as exc:  # fetch_prefix never raises for the store; a bug must not
            log.error("kv-store read for a local prefill failed", request_id=rid, error=repr(exc))
        finally:
            del self._reading[rid]
        if rid in self._aborted:
            self._aborted.discard(rid)
            if fetched is not None:
                self._unused.append(fetched)
        else:
            if fetched is not None:
                self._read[rid] = fetched
            self._ended[rid] = (prompt, params)
        self._wake.set()

    def take_ended(self) -> list[tuple[str, list[int], SamplingOptions]]:
        """``(request id, prompt, options)`` of the requests whose read ended since the last
        call, in the order they ended: the worker queues them now (their blocks are adopted
        when each is added)."""
        ended, self._ended = self._ended, {}
        return [(rid, prompt, params) for rid, (prompt, params) in ended.items()]

    # ---- between steps (under the engine lock, in admit()) -------------------------------------

    def adopt_unused(self) -> None:
        """Aborted requests' reads: cached (they verified), then left to eviction."""
        unused, self._unused = self._unused, []
        for fetched in unused:
            self.reader.adopt(fetched)

    def adopt_for(self, rid: str) -> int:
        """The blocks read for ``rid`` (queued now), adopted into the prefix cache: tokens."""
        fetched = self._read.pop(rid, None)
        return self.reader.adopt(fetched) if fetched is not None else 0

    # ---- aborts ---------------------------------------------------------------------------------

    def abort_reading(self, rid: str) -> list[int] | None:
        """``rid``'s prompt if it is held: its read in flight (the read then frees its blocks)
        or ended and not taken (its blocks go with the next ``admit()``); else None."""
        if rid in self._ended:
            self.abort_queued(rid)
            return self._ended.pop(rid)[0]
        if rid not in self._reading:
            return None
        self._aborted.add(rid)
        return self._reading[rid][0]

    def abort_queued(self, rid: str) -> None:
        """``rid`` was queued after its read and aborted before admission: its blocks go with
        the next ``admit()``."""
        read = self._read.pop(rid, None)
        if read is not None:
            self._unused.append(read)
            self._wake.set()
