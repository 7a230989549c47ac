"""What a receiver learns of the writes into its memory: one ``Completion`` per placed write, in
write order per endpoint, through a ``CompletionQueue`` that backend threads fill and the
receiver's event loop drains."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvmesh.shared.transport.errors import TransportClosedError


@dataclass(frozen=True, slots=True)
class Completion:
    """Delivered to the receiver once per successful write, after all its bytes are placed.

    ``keys`` say whose authority the write came with, so that the receiver can accept an
    immediate only from the holder of the lease it names: on tcp and shm, the one key the write
    used (a window's or a region's; of a tcp write with frames of several keys, the first's); on
    rdma with memory windows, every window key that the connection it arrived on has resolved
    (the NIC let its bytes through memory windows bound for that connection); None where the
    backend cannot tell (rdma without memory windows, where every writer uses the region's key).
    ``peer_id`` is the id the writer declared in its hello: a name for logs, not a proof."""

    imm: int
    peer_id: str
    num_bytes: int
    keys: frozenset[int] | None = None


class CompletionQueue:
    """Thread-safe producer side (``put``), asyncio consumer side (``get`` / ``async for``)."""

    def __init__(self) -> None:
        self._items: deque[Completion] = deque()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False

    def put(self, completion: Completion) -> None:
        """Callable from any thread."""
        with self._lock:
            if self._closed:
                return
            self._items.append(completion)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            _wake(loop, fut)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            _wake(loop, fut)

    def get_nowait(self) -> Completion | None:
        with self._lock:
            return self._items.popleft() if self._items else None

    def qsize(self) -> int:
        return len(self._items)

    async def get(self) -> Completion:
        """Next completion; raises TransportClosedError once closed and drained."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise TransportClosedError("completion queue closed")
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def __aiter__(self) -> AsyncIterator[Completion]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Completion]:
        while True:
            try:
                yield await self.get()
            except TransportClosedError:
                return


def _wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    def _set() -> None:
        if not fut.done():
            fut.set_result(None)

    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # loop closed in between
        loop.call_soon_threadsafe(_set)
