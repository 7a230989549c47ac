"""Grammars compiled off the caller's thread, each within a time limit (issue 40).

A worker's event loop must never build a grammar: xgrammar takes seconds for a deep schema, and
a loop held that long stops the heartbeats (the registry drops the worker) and every other
stream. ``GrammarCompiles`` compiles a request's spec in one of a few daemon threads
(xgrammar releases the GIL while it builds) and answers, on the caller's thread, whether it is
ready: ``ready(spec)`` is True once compiled (then in the ``GrammarBook``'s cache), False while
compiling, and raises StructuredOutputError once it failed, or ran past ``timeout_s`` (timed
from the compile's start: making the compiler, once per worker, is not counted). A failure
is remembered by the book (so a bad spec sent again is refused without compiling); a spec
that only waited behind others past the limit is refused as busy and not remembered.
``AwaitedCompiles`` is the same for a caller that awaits a grammar (the prefill worker).

xgrammar's build cannot be stopped: a compile past its limit runs on in its thread until it
ends, its result dropped. The router's static limits (``shared/text/schema_limits.py``) keep
such compiles rare; the few threads keep them from taking every core.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.engine.grammar import GrammarBook
from kvmesh.shared.text.structured_output import StructuredOutputError, StructuredOutputs

MAX_THREADS = 2


@dataclass(eq=False)
class _Job:
    spec: StructuredOutputs
    submitted_at: float
    picked_at: float | None = None  # set by its thread: no longer queued
    started_at: float | None = None  # set by its thread: compiling (the compiler is made)
    result: Future[Any] = field(default_factory=Future)


class GrammarCompiles:
    """Compiles for one ``GrammarBook``; ``ready`` and ``start`` are called from one thread
    (the worker's event loop), ``on_change`` from the compile threads (it must be thread-safe:
    a compile ended, or one may have run past its limit)."""

    def __init__(
        self,
        book: GrammarBook,
        timeout_s: float,
        on_change: Callable[[], None],
        *,
        max_threads: int = MAX_THREADS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert timeout_s > 0 and max_threads >= 1
        self.book = book
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._clock = clock
        self._max_threads = max_threads
        self._jobs: dict[StructuredOutputs, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` unless it is compiled, failed lately, or compiling."""
        if spec in self._jobs or self.book.is_compiled(spec) or self.book.failure(spec):
            return
        job = _Job(spec, self._clock())
        self._jobs[spec] = job
        if len(self._threads) < self._max_threads:
            thread = threading.Thread(target=self._serve, name="grammar-compile", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._queue.put(job)
        self._wake_in(self.timeout_s + 0.01)  # to refuse it as busy if it has not started

    def ready(self, spec: StructuredOutputs) -> bool:
        """Whether ``spec`` is compiled (``start`` it first); StructuredOutputError: it failed
        (now or lately), or waited past the limit behind other compiles."""
        if self.book.is_compiled(spec):
            return True
        reason = self.book.failure(spec)
        if reason is not None:
            raise StructuredOutputError(reason)
        job = self._jobs.get(spec)
        assert job is not None, "ready() before start()"
        now = self._clock()
        if job.result.done():
            del self._jobs[spec]
            try:
                compiled = job.result.result()
            except StructuredOutputError as exc:
                self.book.fail(spec, str(exc))
                raise
            self.book.add(spec, compiled)
            return True
        if job.started_at is not None and now - job.started_at >= self.timeout_s:
            del self._jobs[spec]  # its thread runs on; what it builds is dropped
            reason = (
                f"compiling the grammar took over {self.timeout_s:g} s (the worker's limit, "
                "--grammar-compile-timeout-s); simplify the schema, regex or grammar"
            )
            self.book.fail(spec, reason)
            raise StructuredOutputError(reason)
        if job.picked_at is None and now - job.submitted_at >= self.timeout_s:
            del self._jobs[spec]
            job.result.cancel()  # its thread skips it
            raise StructuredOutputError(
                f"the worker's grammar compiler was busy for {self.timeout_s:g} s with other "
                "grammars; retry later"
            )
        return False

    def close(self) -> None:
        """Stop the threads once their compiles end (daemons: they never hold up an exit)."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads.clear()
        for job in self._jobs.values():
            job.result.cancel()
        self._jobs.clear()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.result.set_running_or_notify_cancel():
                continue  # refused as busy before it started
            job.picked_at = self._clock()
            try:  # the first compile makes the compiler (the vocabulary's tables): not timed
                self.book.compiler()
            except Exception as exc:
                job.result.set_exception(StructuredOutputError(f"no grammar compiler: {exc!r}"))
                self._on_change()
                continue
            job.started_at = self._clock()
            limit = self._wake_in(self.timeout_s + 0.01)  # ready() sees it past the limit
            try:
                job.result.set_result(self.book.compile(job.spec))
            except StructuredOutputError as exc:
                job.result.set_exception(exc)
            except Exception as exc:  # a bug in the build must fail its requests, not the thread
                job.result.set_exception(StructuredOutputError(f"compiling failed: {exc!r}"))
            finally:
                limit.cancel()
            self._on_change()

    def _wake_in(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self._on_change)
        timer.daemon = True
        timer.start()
        return timer


class AwaitedCompiles:
    """``GrammarCompiles`` for a worker that awaits one grammar per job (prefill: a remote
    prefill samples its first token under the request's grammar). ``await ready(spec)``
    returns once ``spec`` is compiled, meanwhile the event loop and the engine lock are free;
    StructuredOutputError once it failed, or ran past ``timeout_s``. Made on first use, on the
    loop that awaits it."""

    def __init__(self, book: GrammarBook, timeout_s: float) -> None:
        self.book = book
        self.timeout_s = timeout_s
        self._compiles: GrammarCompiles | None = None
        self._changed: asyncio.Event | None = None

    async def ready(self, spec: StructuredOutputs) -> None:
        if self._compiles is None:
            loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
            self._compiles = GrammarCompiles(
                self.book, self.timeout_s, lambda: _call_soon(loop, self._on_change)
            )
        while True:
            assert self._changed is not None
            changed = self._changed  # the next change's, taken before looking
            self._compiles.start(spec)  # again after a busy refusal of another waiter: retried
            if self._compiles.ready(spec):
                return
            await changed.wait()

    def close(self) -> None:
        if self._compiles is not None:
            self._compiles.close()

    def _on_change(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop``, from another thread (nothing once the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
