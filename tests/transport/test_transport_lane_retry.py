"""A writer whose lane handshakes are reset tries again with backoff (issue 40 #5): a restarted
prefill's lanes were reset under a connection flood, and it answered 502 ("cannot reach tcp
peer") at the first reset. The receiver here is the real one, resetting (SO_LINGER 0) the first
connections it accepts the way it resets a source over its accept budget."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from kvmesh.shared.transport import (
    Access,
    PeerUnreachableError,
    TransportConfig,
    WriteEntry,
    tcp_endpoint,
)
from kvmesh.shared.transport.endpoint_cache import EndpointCache
from kvmesh.shared.transport.source_budget import BudgetVerdict, SourceGuard
from kvmesh.shared.transport.tcp import TcpTransport
from support.transport_wire import remote


class ResetFirst:
    """The receiver's source guard, but the first ``n`` connections (or every one) are reset at
    accept, as if their source were over its budget."""

    def __init__(self, guard: SourceGuard, n: int | None) -> None:
        self.guard, self.left = guard, n

    def admit(self, source: str) -> BudgetVerdict:
        if self.left is None:
            return BudgetVerdict.RATE_LIMITED
        if self.left:
            self.left -= 1
            return BudgetVerdict.RATE_LIMITED
        return self.guard.admit(source)


def _count_tries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every lane connect the writer starts (``_open_lane``), by lane index."""
    tries: list[int] = []
    real = tcp_endpoint._open_lane

    def counted(address, timeout_s, secret, hello):
        tries.append(hello[0])
        return real(address, timeout_s, secret, hello)

    monkeypatch.setattr(tcp_endpoint, "_open_lane", counted)
    return tries


@contextlib.asynccontextmanager
async def _resetting_pair(
    resets: int | None, connect_retry_s: float
) -> AsyncIterator[tuple[TcpTransport, TcpTransport, Any]]:
    """A receiver that resets its first ``resets`` connections (None: every one) and a writer on
    TCP lanes (no unix sockets) that tries for ``connect_retry_s``: (rx, tx, the receiver's server)."""
    async with (
        TcpTransport(TransportConfig()) as rx,
        TcpTransport(TransportConfig(connect_retry_s=connect_retry_s, tcp_unix_lanes=False)) as tx,
    ):
        server = rx._server
        assert server is not None and server.guard is not None
        server.guard = ResetFirst(server.guard, resets)  # type: ignore[assignment]
        yield rx, tx, server


async def test_a_prefill_writer_retries_reset_handshakes_and_its_write_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tries = _count_tries(monkeypatch)
    async with _resetting_pair(4, connect_retry_s=30.0) as (rx, tx, server):
        mem = rx.allocate(4096)
        region = remote(rx, rx.register(mem, Access.REMOTE_WRITE))
        src = tx.register(torch.full((4096,), 9, dtype=torch.uint8))
        async with EndpointCache(tx) as endpoints:  # the prefill worker's path to decode
            endpoint = await endpoints.get(rx.descriptor())
            await asyncio.wait_for(
                endpoint.write([WriteEntry(src, 0, region.addr, region.rkey, 4096)], 5), 30
            )
        assert (await rx.completion_queue.get()).imm == 5
        assert bool((mem == 9).all())
        # lane 0: four resets then its hello; lane 1 at its first try
        assert tries == [0, 0, 0, 0, 0, 1]
        assert server.num_throttled == 4 and server.num_accepted == 2


async def test_a_writer_reset_every_time_gives_up_at_its_deadline_naming_its_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tries = _count_tries(monkeypatch)
    async with _resetting_pair(None, connect_retry_s=0.3) as (rx, tx, server):
        with pytest.raises(PeerUnreachableError, match="cannot reach tcp peer") as refused:
            await tx.connect(rx.descriptor())
    assert len(tries) > 1 and set(tries) == {0}  # tried again; lane 1 never started
    assert f"({len(tries)} tries in 0.3 s)" in str(refused.value)
    assert server.num_throttled == len(tries)
