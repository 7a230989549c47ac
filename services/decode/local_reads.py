"""Local prefills that read their prompt's prefix from a kv-store before they are queued.

A decode worker given a PrefixReader (``--use-kv-store``) starts, for a local-prefill request it
accepted while a store is known, a read of the prefix blocks its own cache lacks; the request is
queued for the engine (``on_ready``) when the read ends, well or not (best effort: what was not
read is computed). Its blocks are adopted into the prefix cache by the worker's next ``admit()``,
between steps. A request aborted while its read runs, or after it ended but before it was
queued, has its blocks adopted (they verified) and then left to the cache's eviction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.shared.mesh.kv_store_prefix import Fetched, PrefixReader
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions

log = logs.get_logger(__name__)


class LocalPrefixReads:
    def __init__(
        self,
        reader: PrefixReader,
        lock: asyncio.Lock,
        on_ready: Callable[[str, list[int], SamplingOptions], None],
        wake: Callable[[], None],
    ) -> None:
        """``lock``: the engine's (a read adopts nothing, but pins what it reuses under it);
        ``on_ready(rid, prompt, params)``: queue the request once its read ended; ``wake``:
        there is something for ``admit()``."""
        self.reader = reader
        self._lock = lock
        self._on_ready = on_ready
        self._wake = wake
        self._reading: dict[str, tuple[list[int], asyncio.Task[None]]] = {}
        self._aborted: set[str] = set()  # aborted while reading
        self._read: dict[str, Fetched] = {}  # read, the request queued: adopted by admit()
        self._unused: list[Fetched] = []  # reads of aborted requests: adopted, then freed

    @property
    def can_read(self) -> bool:
        """A kv-store is known to read from."""
        return self.reader.stores.target() is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reading

    def __len__(self) -> int:
        """Reads in flight."""
        return len(self._reading)

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
            self._on_ready(rid, prompt, params)
        self._wake()

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
        """``rid``'s prompt if its read is in flight (the read then frees its blocks), else
        None."""
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
            self._wake()
