"""Hostile connections against a tcp receiver (issue #27), for ``kvmesh bench hostile`` and the
bounded attack in ``tests/transport/test_transport_hostile.py``.

Each connection is one asyncio task that reconnects within a second of the receiver dropping
it, so the pressure stays for the whole run. Kinds:

- ``hello``: a local user without the mesh's secret. Half send a complete hello whose proof is
  wrong (on a receiver without lane authentication: a valid hello) and hold the connection;
  half send a third of a hello and fall silent.
- ``badkey``: a mesh member gone rogue (it knows the secret): frames with random keys, as fast
  as the receiver answers, until it is disconnected.
- ``stall``: a rogue member that announces a 1 GiB frame, sends 4 KiB and stops.

Insiders declare one peer id per kind (the receiver's per-peer limit bounds each); an insider
that rotates peer ids can hold up to ``max_connections`` lanes (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.shared.transport.lane_auth import (
    ACCEPT,
    CHALLENGE,
    HELLO,
    MAC_BYTES,
    MAGIC_HELLO,
    answer_challenge,
)
from kvmesh.shared.transport.tcp import FRAME, MAGIC_FRAME, MAX_FRAME_BYTES, OP_WRITE, VERSION

KINDS = ("hello", "badkey", "stall")
# Between a drop and the next connect (0.5-1 s): every connection is back within a second, so
# the pressure stays, without turning the attack into a busy loop on the attacker's own cores.
_BACKOFF_S = 0.5
# the hello format of a receiver without lane authentication (version 1: no challenge, no MAC)
_V1_HELLO = struct.Struct("<4sHHHQH")


@dataclass(slots=True)
class HostileTally:
    """What the hostile side saw: connects, drops by the receiver, frames sent, per kind."""

    connects: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    frames: Counter[str] = field(default_factory=Counter)
    admitted: Counter[str] = field(default_factory=Counter)  # insiders past the handshake


def mix(total: int) -> dict[str, int]:
    """The default split of ``total`` connections: 80% outsiders' hellos, 10% each insider kind."""
    insiders = total // 10
    return {"hello": total - 2 * insiders, "badkey": insiders, "stall": insiders}


def _frame(rkey: int, addr: int, length: int, seq: int) -> bytes:
    return FRAME.pack(
        MAGIC_FRAME, VERSION, OP_WRITE, 0, rkey, 0, addr, length, seq, 0, 1, addr, length
    )


class HostileLoad:
    """``counts`` connections per kind against ``host:port`` until ``stop()``; ``secret`` is the
    receiver's (insiders know it), ``target_addr`` an address in its pool."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        counts: dict[str, int],
        target_addr: int = 0x1000,
        seed: int = 0,
        source: str | None = None,
    ) -> None:
        self.address = (host, port)
        # the address to connect from (e.g. another 127.0.0.x): a receiver budgets by source
        self.local_addr = (source, 0) if source else None
        self.secret = secret
        self.counts = counts
        self.target_addr = target_addr
        self.rng = random.Random(seed)
        self.tally = HostileTally()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> HostileLoad:
        runners: dict[str, Callable[..., Awaitable[None]]] = {
            "hello": self._hello,
            "badkey": self._badkey,
            "stall": self._stall,
        }
        for kind, n in self.counts.items():
            for i in range(n):
                coro = self._forever(kind, runners[kind], i)
                self._tasks.append(asyncio.ensure_future(coro))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _forever(self, kind: str, run: Callable[..., Awaitable[None]], i: int) -> None:
        while not self._stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.open_connection(
                    *self.address, local_addr=self.local_addr
                )
                self.tally.connects[kind] += 1
                await run(i, reader, writer)
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                self.tally.dropped[kind] += 1
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
            await asyncio.sleep(_BACKOFF_S * (1 + self.rng.random()))

    async def _challenge(self, reader: asyncio.StreamReader) -> bytes:
        return await reader.readexactly(CHALLENGE.size)

    async def _hello(
        self, i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """An outsider: no secret. Waits for a challenge a short while (a receiver without lane
        authentication sends none), then holds a wrong or partial hello open."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._challenge(reader), 0.5)
        peer = b"outsider-%d" % i
        hello = _V1_HELLO.pack(MAGIC_HELLO, 1, 0, 1, i, len(peer)) + peer
        if i % 2 == 0:  # the shape of a v2 hello, proven with a wrong secret
            header = HELLO.pack(MAGIC_HELLO, 2, 0, 1, i, len(peer))
            hello = hello if not i % 4 else header + peer + bytes(MAC_BYTES)
            writer.write(hello)
        else:
            writer.write(hello[: len(hello) // 3])
        await writer.drain()
        await reader.read(1)  # held until the receiver hangs up

    async def _admit(
        self, kind: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        challenge = await self._challenge(reader)
        endpoint_id = self.rng.getrandbits(63)
        writer.write(answer_challenge(self.secret, challenge, 0, 1, endpoint_id, f"rogue-{kind}"))
        await writer.drain()
        if await reader.readexactly(len(ACCEPT)) != ACCEPT:
            raise ConnectionError("not admitted")
        self.tally.admitted[kind] += 1

    async def _badkey(
        self, i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A rogue member probing keys: one-byte writes with random keys until disconnected."""
        await self._admit("badkey", reader, writer)
        seq = 1
        while True:
            rkey = self.rng.getrandbits(32)
            writer.write(_frame(rkey, self.target_addr, 1, seq) + b"x")
            await writer.drain()
            self.tally.frames["badkey"] += 1
            seq += 1
            if not await reader.read(64):  # its NAK; EOF when the receiver hung up
                return

    async def _stall(
        self, i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A rogue member announcing a 1 GiB frame, sending 4 KiB of it, then nothing."""
        await self._admit("stall", reader, writer)
        rkey = self.rng.getrandbits(32)
        writer.write(_frame(rkey, self.target_addr, MAX_FRAME_BYTES, 1) + bytes(4096))
        await writer.drain()
        self.tally.frames["stall"] += 1
        await reader.read(1)  # held until the receiver hangs up


__all__ = ["KINDS", "HostileLoad", "HostileTally", "mix"]
