"""Structured outputs' grammars compiled before their requests reach a decode worker's engine.

A request with a structured output waits, accepted, until its grammar is compiled: in a thread,
within ``timeout_s`` (``shared/engine/grammar_compile.py``), never on the event loop or under the
engine lock, so heartbeats and other streams go on meanwhile. Its compile starts as it is
accepted (a remote prefill's runs while the prefill does); ``admit()`` asks ``ready`` between
steps and adds only the requests whose grammar is in. One that failed (or ran past the limit)
gets its final event; its spec is refused at once after that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from kvmesh.services.decode.pending import Verdict
from kvmesh.shared.engine.grammar import GrammarBook
from kvmesh.shared.engine.grammar_compile import GrammarCompiles
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputError


class GrammarGate:
    def __init__(
        self, book: GrammarBook | None, timeout_s: float, wake: Callable[[], None]
    ) -> None:
        """``book``: the engine's grammars (None: it refuses structured outputs, no tokenizer);
        ``wake``: a compile ended, or ran past its limit (called on the event loop)."""
        self._book = book
        self._timeout_s = timeout_s
        self._wake = wake
        self.compiles: GrammarCompiles | None = None  # made with the first structured output

    def ready(self, params: SamplingOptions) -> bool:
        """Whether the request's grammar is compiled (or it has none): ``add_request`` then
        compiles nothing. StructuredOutputError: it failed."""
        spec = params.structured_outputs
        if spec is None or self._book is None:
            return True  # none, or the engine refuses it
        if self.compiles is None:
            loop = asyncio.get_running_loop()
            self.compiles = GrammarCompiles(
                self._book, self._timeout_s, lambda: _call_soon(loop, self._wake)
            )
        self.compiles.start(spec)
        return self.compiles.ready(spec)

    def start(self, params: SamplingOptions) -> None:
        """Start the compile of an accepted request's grammar (if any)."""
        with contextlib.suppress(StructuredOutputError):  # failed lately: admit() says so
            self.ready(params)

    def settled(self, verdict: Verdict) -> bool:
        """Whether a reservation's verdict can be applied now: not one to admit, or its grammar
        compiled or failed (the engine then refuses it at once)."""
        if not verdict.ok or verdict.lease.is_aborted:
            return True
        assert verdict.lease.admission is not None
        try:
            return self.ready(verdict.lease.admission.params)
        except StructuredOutputError:
            return True

    def close(self) -> None:
        """Stop the compile threads (a compile in flight ends on its own)."""
        if self.compiles is not None:
            self.compiles.close()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop``, from another thread (nothing once the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
