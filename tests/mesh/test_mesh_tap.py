"""The tests' NATS tap (kvmesh/testing/mesh.py ``MeshTap``) follows a request across the wire ids
the router gives its attempts, against a real nats-server: a retry (``-rN``) after an attempt
that was aborted before its first token, a migration (``-mN``) that carries the rest of a stream,
and a plain request; a finish that ends an abandoned attempt is not the answer."""

from __future__ import annotations

import asyncio

import pytest
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.wire_ids import attempt_of
from kvmesh.shared.config.subjects import Subjects

from kvmesh.testing.mesh import MeshTap

S = Subjects("kvmesh-tiny")


def test_wire_ids_name_their_reply_and_attempt() -> None:
    assert attempt_of("cmpl-0af3") == ("cmpl-0af3", 0)
    assert attempt_of("cmpl-0af3-r1") == ("cmpl-0af3", 1)
    assert attempt_of("cmpl-0af3-m12") == ("cmpl-0af3", 12)
    assert attempt_of("cmpl-0af3-x1") == ("cmpl-0af3-x1", 0)
    assert attempt_of("cmpl-0af3-r") == ("cmpl-0af3-r", 0)
    assert attempt_of("plain") == ("plain", 0)


async def test_a_reply_is_followed_across_retries_and_migrations(nats_server: str) -> None:
    async with MeshTap(nats_server) as tap, connect_nats(nats_server, "decode") as nc:

        async def send(wire_id: str, tokens: tuple[int, ...], finish: str | None = None) -> None:
            event = TokenEvent(wire_id, tokens, finish_reason=finish)
            await nc.publish(S.request_tokens(wire_id), encode_message(event))
            await flush_to_server(nc)

        await send("cmpl-a", (1, 2, 3), "length")  # no retry
        await send("cmpl-b", (), "abort")  # given up before its first token...
        waiting = asyncio.create_task(tap.wait_answered("cmpl-b", timeout_s=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # ...an abort is not the answer
        await send("cmpl-b-r1", (7,))
        await send("cmpl-b-r1", (8,), "stop")
        final, tokens = await waiting
        assert (final.request_id, final.finish_reason, tokens) == ("cmpl-b-r1", "stop", [7, 8])
        await send("cmpl-c", (4, 5))  # its decode worker died mid-stream...
        await send("cmpl-c-m1", (6,), "length")  # ...and the rest came from another
        final, tokens = await tap.wait_answered("cmpl-c", timeout_s=10)
        assert (final.request_id, tokens) == ("cmpl-c-m1", [4, 5, 6])
        assert tap.attempts("cmpl-c") == ["cmpl-c", "cmpl-c-m1"]
        final, tokens = await tap.wait_answered("cmpl-a", timeout_s=10)
        assert (final.request_id, tokens) == ("cmpl-a", [1, 2, 3])
        assert tap.answer("cmpl-d") is None
        with pytest.raises(TimeoutError, match="no finish heard for cmpl-d"):
            await tap.wait_answered("cmpl-d", timeout_s=0.2)
