"""How long a service runs: its background coroutines for a block, and until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


@contextlib.asynccontextmanager
async def background(*coros: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Run coroutines as tasks of a TaskGroup for the duration of the block; cancel them on exit.

    A task that fails cancels the block (TaskGroup semantics) and its error propagates."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(c) for c in coros]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()


async def serve_until_signal(
    stop: asyncio.Event | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> signal.Signals | None:
    """Wait for SIGTERM/SIGINT (returns it) or for ``stop`` to be set (returns None)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not got.done():
            got.set_result(sig)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    waiters: list[asyncio.Future[Any]] = [got]
    stop_task = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stop_task is not None:
        waiters.append(stop_task)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if stop_task is not None:
            stop_task.cancel()
    if got.done():
        log.info("signal received, stopping", signal=got.result().name)
        return got.result()
    return None
