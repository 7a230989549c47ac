"""Fuzz campaign against the data plane's receivers (issue #15, docs/security.md).

What crosses the trust boundary, and what is fuzzed here:

* tcp: all a peer sends on a lane, a hello and then 64-byte frame headers with payloads. The
  receiver checks a header against its registry before it reads the payload, reads the payload
  straight into registered memory, NAKs a refusal and drops the connection on a corrupt frame.
* shm: a writer copies into the receiver's segments itself, after checking each entry against the
  receiver's region table; the receiver parses only its notification socket (a hello, then 24-byte
  notes). So the campaign fuzzes the notes the receiver parses, the write entries a writer checks
  against the table, and (separately) the table rows a writer parses.

Memory: one allocation per receiver holds a registration of every kind (read-write, write-only,
read-only, local-only, deregistered) at odd offsets and lengths, with guard bytes of a known value
before, between and after them; region bytes start random. ``Arena`` models every byte. A valid
write updates the model; a frame that a reference check says the receiver may place with undefined
content (a broken tail frame) makes its target bytes "wild" for that connection only. After every
connection every byte that is not wild must equal the model, guards included, so a failure names
the connection and the frames that broke it.

A tcp connection carries a hello, 1-40 "soft" frames (valid ones, and ones with one field mutated
so that the receiver must refuse them and keep the connection: rkey, address, span, access,
immediate, flags, a read in place of a write, an oversize refused payload), whose ACKs and NAKs,
completions and counters are predicted exactly, then maybe one "hard" tail (a mutated length,
address, span, index, count, sequence number, magic, version or op, bit flips, truncation, oversize
and overflowing values, garbage), after which the receiver may drop the connection. Other
connections carry a mutated hello or only random bytes. A long-lived real endpoint writes between
connections, so valid writes interleave with garbage. Frames are batched per connection; the test
half-closes each connection and reads the answers until the receiver hangs up (a hang fails).

After the campaign: guards and every byte no valid write targeted are intact, refusals were
counted, no receiver thread, connection, peer state or descriptor is left behind, and a fresh
endpoint's write lands. Reproduce a failure with the seed its message names:
``KVMESH_FUZZ_SEED=<seed> pytest tests/transport/test_transport_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch
from kvmesh.shared.transport import (
    Access,
    CompletionQueue,
    Endpoint,
    MemoryRegion,
    RefusalReason,
    RemoteAccessError,
    TransportConfig,
    TransportError,
    TransportStats,
    WriteEntry,
)
from kvmesh.shared.transport.lane_auth import ACCEPT, CHALLENGE, HELLO, MAGIC_HELLO, _mac
from kvmesh.shared.transport.server import SocketServer
from kvmesh.shared.transport.shm import (
    FREE,
    LIVE,
    NOTE,
    OP_HELLO,
    OP_READ_DONE,
    OP_REFUSED,
    OP_WRITE_DONE,
    RETIRED,
    ShmTransport,
)
from kvmesh.shared.transport.shm_segments import UntrustedDescriptorError
from kvmesh.shared.transport.tcp import (
    ACK,
    FLAG_NO_ACK,
    FRAME,
    MAGIC_ACK,
    MAGIC_FRAME,
    MAX_FRAME_BYTES,
    MAX_PENDING_WRITES,
    OP_READ,
    OP_WRITE,
    VERSION,
    TcpTransport,
)

SEED = int(os.environ.get("KVMESH_FUZZ_SEED", "0x5eedf022"), 0)
# The campaign probes refusals by the thousand on one connection, from thousands of connections
# of one address: no disconnect, no per-source budget for them here (test_transport_windows.py,
# test_transport_hostile.py and test_transport_source_budget.py check those).
RX_CONFIG = TransportConfig(
    max_refusals=1 << 30, max_refusals_per_source=1 << 30, accept_burst_per_source=1 << 30
)
FRAMES_PER_TRANSPORT = 10_000
TABLE_TRIALS = 600
GUARD = 0xAB
M8, M16, M32, M64 = 0xFF, 0xFFFF, 0xFFFF_FFFF, (1 << 64) - 1
EXCHANGE_TIMEOUT_S = 10.0  # a receiver that has not hung up by then is stuck
FD_SLACK = 4


def fail(ctx: str, message: str) -> str:
    return f"[seed={SEED:#x} {ctx}] {message}"


# ---- memory: registered regions between guard bytes, and the model of every byte ---------------


@dataclass(frozen=True)
class Slot:
    name: str
    length: int
    access: Access
    retired: bool = False


SLOTS = (
    Slot("rw", 16384, Access.REMOTE),
    Slot("w", 8191, Access.REMOTE_WRITE),
    Slot("r", 4096, Access.REMOTE_READ),
    Slot("local", 2048, Access.LOCAL),
    Slot("gone", 4096, Access.REMOTE_WRITE, retired=True),
)
GUARDS = (4096, 513, 1001, 64, 333, 4096)  # before, between and after the slots


class Arena:
    """Every kind of registration in one allocation, guard bytes around each, and the model."""

    def __init__(self, transport: TcpTransport | ShmTransport, rng: random.Random) -> None:
        size = sum(GUARDS) + sum(s.length for s in SLOTS)
        self.mem = transport.allocate(size)
        self.base = self.mem.data_ptr()
        self.actual = self.mem.numpy()
        self.expected = np.full(size, GUARD, dtype=np.uint8)
        self.owner = np.full(size, -1, dtype=np.int8)  # index into SLOTS; -1: a guard byte
        self.wild = np.zeros(size, dtype=bool)
        spans = []
        offset = GUARDS[0]
        for i, (slot, gap) in enumerate(zip(SLOTS, GUARDS[1:], strict=True)):
            end = offset + slot.length
            self.expected[offset:end] = np.frombuffer(rng.randbytes(slot.length), np.uint8)
            self.owner[offset:end] = i
            spans.append((slot, offset, end))
            offset = end + gap
        self.actual[:] = self.expected
        # name -> the region as peers reach it: the key of a window over all of it (a region's
        # own key opens nothing remotely; "local" keeps its own key, which opens nothing)
        self.regions: dict[str, MemoryRegion] = {}
        self.live: dict[int, MemoryRegion] = {}
        self.retired: set[int] = set()
        for slot, start, end in spans:
            region = transport.register(self.mem[start:end], slot.access)
            if slot.access == Access.LOCAL:
                self.regions[slot.name] = region
                continue
            window = transport.open_window(region, [(region.addr, region.length)], slot.access)
            self.regions[slot.name] = msgspec.structs.replace(region, rkey=window.rkey)
            if slot.retired:
                transport.deregister(region)  # closes its window
                self.retired.add(window.rkey)
            else:
                self.live[window.rkey] = self.regions[slot.name]

    def refusal(self, rkey: int, addr: int, length: int, access: Access) -> int:
        """The RefusalReason (0: allowed) due to an access of ``[addr, +length)`` of ``rkey``, as
        the registry (or an shm writer reading the region table) judges it; every refusal is
        ``REFUSED`` to the peer, whatever its cause."""
        region = self.live.get(rkey)
        refused = (
            region is None
            or region.access & access != access
            or length <= 0
            or addr < region.addr
            or addr + length > region.end
        )
        return RefusalReason.REFUSED if refused else 0

    def span_in(self, rng: random.Random, name: str, cap: int = 512) -> tuple[int, int]:
        """A random ``(addr, length)`` inside region ``name``."""
        region = self.regions[name]
        length = min(region.length, random_length(rng, cap))
        return region.addr + rng.randrange(region.length - length + 1), length

    def write(self, addr: int, data: bytes) -> None:
        start = addr - self.base
        self.expected[start : start + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, addr: int, length: int) -> bytes:
        start = addr - self.base
        return self.expected[start : start + length].tobytes()

    def allow(self, addr: int, length: int) -> None:
        """The receiver may have placed anything in ``[addr, +length)`` (a broken tail frame)."""
        start = addr - self.base
        assert (self.owner[start : start + length] >= 0).all(), "the reference allowed a guard"
        self.wild[start : start + length] = True

    def settle(self, ctx: str) -> None:
        """Every byte that is not wild equals the model; then the wild bytes become known."""
        bad = np.flatnonzero((self.actual != self.expected) & ~self.wild)
        if bad.size:
            i = int(bad[0])
            where = "a guard" if self.owner[i] < 0 else f"region {SLOTS[self.owner[i]].name!r}"
            raise AssertionError(
                fail(
                    ctx,
                    f"{bad.size} bytes changed that no write may have touched; the first at "
                    f"offset {i} in {where}: {self.actual[i]:#04x}, expected {self.expected[i]:#04x}",
                )
            )
        self.expected[self.wild] = self.actual[self.wild]
        self.wild[:] = False

    def guards_intact(self) -> bool:
        return bool((self.actual[self.owner < 0] == GUARD).all())


def random_length(rng: random.Random, cap: int) -> int:
    roll = rng.random()
    if roll < 0.1:
        return 1
    if roll < 0.5:
        return rng.randint(2, 64)
    if roll < 0.9:
        return rng.randint(65, 512)
    return rng.randint(513, max(513, cap))


def random_flags(rng: random.Random) -> int:
    return rng.choice([0, 0, FLAG_NO_ACK, FLAG_NO_ACK, rng.getrandbits(16)])


def flip_bits(rng: random.Random, data: bytes, limit: int) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        bit = rng.randrange(8 * min(limit, len(out)))
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


# ---- the wire: a socket exchange, and the receivers' own checks as a reference ------------------


Hello = Callable[[bytes], bytes]  # the receiver's challenge -> the hello that answers it


def exchange(
    family: int, address: object, data: bytes, hello: Hello | None = None
) -> tuple[bytes, bool]:
    """Send ``data`` (tcp: after ``hello``'s answer to the receiver's challenge), half-close,
    and read all the receiver answers until it hangs up (reading all the while, so neither
    side blocks on a full buffer). Returns (answers, reset)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sel = selectors.DefaultSelector()
    received, reset = bytearray(), False
    try:
        sock.connect(address)
        if hello is not None:
            sock.settimeout(EXCHANGE_TIMEOUT_S)
            challenge = sock.recv(CHALLENGE.size, socket.MSG_WAITALL)
            assert len(challenge) == CHALLENGE.size, "the receiver sent no challenge"
            data = hello(challenge) + data
        out = memoryview(data)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
        sending = True
        while True:
            if sending and not out:
                sending = False
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                sel.modify(sock, selectors.EVENT_READ)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the receiver did not hang up in {EXCHANGE_TIMEOUT_S} s")
            for _, events in sel.select(left):
                if events & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 16)
                    except BlockingIOError:
                        chunk = None
                    except ConnectionResetError:
                        return bytes(received), True
                    if chunk == b"":
                        return bytes(received), reset
                    received += chunk or b""
                if events & selectors.EVENT_WRITE and out:
                    try:
                        out = out[sock.send(out[: 1 << 16]) :]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        out, reset = memoryview(b""), True
    finally:
        sel.close()
        sock.close()


async def round_trip(
    family: int, address: object, data: bytes, ctx: str, hello: Hello | None = None
) -> tuple[bytes, bool]:
    """``exchange`` in a thread; a receiver that does not hang up fails the test."""
    try:
        return await asyncio.to_thread(exchange, family, address, data, hello)
    except TimeoutError as exc:
        raise AssertionError(fail(ctx, str(exc))) from None


def frame_ok(fields: tuple) -> bool:
    """The tcp receiver's checks of a frame header that close the connection when they fail."""
    magic, version, op, _, _, _, addr, length, _, idx, count, span, span_len = fields
    return (
        magic == MAGIC_FRAME
        and version == VERSION
        and op in (OP_WRITE, OP_READ)
        and 0 < length <= MAX_FRAME_BYTES
        and idx < count
        and span <= addr <= addr + length <= span + span_len
    )


@dataclass
class Walk:
    """What a tcp stream may make the receiver do, at most (ignoring its sequence checks)."""

    frames: int = 0  # headers the receiver accepts as frames
    writes: list[tuple[int, int, int]] = field(default_factory=list)  # (addr, length, imm)


def walk_frames(data: bytes, arena: Arena) -> Walk:
    walk, pos = Walk(), 0
    while pos + FRAME.size <= len(data):
        fields = FRAME.unpack_from(data, pos)
        if not frame_ok(fields):
            break
        _, _, op, _, rkey, imm, addr, length, _, _, _, span, span_len = fields
        walk.frames += 1
        pos += FRAME.size
        if op == OP_WRITE:
            if not arena.refusal(rkey, span, span_len, Access.REMOTE_WRITE):
                walk.writes.append((addr, length, imm))
            pos += length
    return walk


def tcp_hello(
    secret: bytes, challenge: bytes, peer: bytes, endpoint_id: int, n: int | None = None
) -> bytes:
    """A hello proven with ``secret`` for ``challenge`` (``n``: the peer id length it claims)."""
    size = len(peer) if n is None else n
    header = HELLO.pack(MAGIC_HELLO, VERSION, 0, 1, endpoint_id & M64, size & M16)
    return header + peer + _mac(secret, CHALLENGE.unpack(challenge)[2], header, peer)


def drain(queue: CompletionQueue) -> list[tuple[int, str, int]]:
    out = []
    while (c := queue.get_nowait()) is not None:
        out.append((c.imm, c.peer_id, c.num_bytes))
    return out


def transport_threads() -> int:
    return sum(t.name.startswith(("tcp-", "shm-")) for t in threading.enumerate())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, fail("after the campaign", f"{what} not reached")
        await asyncio.sleep(0.01)


def counters(stats: TransportStats) -> np.ndarray:
    fields = (stats.writes, stats.bytes, stats.reads, stats.read_bytes, stats.refused)
    return np.array(fields, dtype=object)


async def assert_no_leaks(server: SocketServer, threads: int, fds: int, connections: int) -> None:
    """Every connection of the campaign is gone with its thread and descriptor; each was
    admitted or refused at its hello (a broken hello, garbage), none lost."""
    await wait_until(lambda: server.num_connections == 0, "no connection left")
    await wait_until(lambda: server.num_pending == 0, "no handshake left")
    await wait_until(lambda: transport_threads() <= threads, "no transport thread left")
    assert server.num_accepted + server.num_refused >= connections
    leaked = open_fds() - fds
    assert leaked <= FD_SLACK, fail("after the campaign", f"{leaked} descriptors leaked")


# ---- tcp frames ---------------------------------------------------------------------------------


@dataclass
class TcpFrame:
    """One frame; any field may hold an out-of-range value (packed modulo its width)."""

    rkey: int
    addr: int
    length: int
    seq: int
    imm: int = 0
    op: int = OP_WRITE
    flags: int = 0
    idx: int = 0
    count: int = 1
    span: tuple[int, int] | None = None  # default: the frame itself
    magic: bytes = MAGIC_FRAME
    version: int = VERSION
    payload: bytes = b""

    def header(self) -> bytes:
        span_addr, span_len = self.span or (self.addr, self.length)
        return FRAME.pack(
            self.magic, self.version & M8, self.op & M8, self.flags & M16, self.rkey & M32,
            self.imm & M32, self.addr & M64, self.length & M64, self.seq & M64, self.idx & M32,
            self.count & M32, span_addr & M64, span_len & M64,
        )  # fmt: skip

    def wire(self) -> bytes:
        return self.header() + (b"" if self.op == OP_READ else self.payload)


SOFT_KINDS = ("write", "read", "rkey", "bounds", "span", "access", "imm_flags", "drain")
SOFT_WEIGHTS = (40, 10, 12, 15, 8, 8, 6, 0.3)
HARD_KINDS = (
    "magic", "version", "op", "length", "addr", "span", "index", "seq", "truncate", "bits",
    "garbage",
)  # fmt: skip


def valid_write(rng: random.Random, arena: Arena, seq: int) -> TcpFrame:
    name = rng.choice(["rw", "w"])
    addr, length = arena.span_in(rng, name, 4096)
    frame = TcpFrame(arena.regions[name].rkey, addr, length, seq, imm=rng.getrandbits(32))
    frame.flags, frame.payload = random_flags(rng), rng.randbytes(length)
    region = arena.regions[name]
    if rng.random() < 0.3:  # one frame of a longer run: the receiver checks the whole run
        lo = rng.randint(region.addr, addr)
        frame.span = (lo, rng.randint(addr + length, region.end) - lo)
    return frame


def soft_frame(rng: random.Random, arena: Arena, seq: int, kind: str) -> TcpFrame:
    """A frame the receiver must answer without dropping the connection (``seq``: the next
    write's sequence number); ``kind`` names the field changed from a valid frame, if any."""
    regions = arena.regions
    frame = valid_write(rng, arena, seq)
    if kind == "read":  # of any region: only "r" and "rw" may be read
        name = rng.choice(["r", "rw", "r", "w", "local"])
        addr, length = arena.span_in(rng, name, 2048)
        frame = TcpFrame(regions[name].rkey, addr, length, rng.getrandbits(64), op=OP_READ)
        frame.flags, frame.idx, frame.count = random_flags(rng), 0, rng.randint(1, M32)
    elif kind == "rkey":
        frame.rkey = rng.choice(
            [
                rng.getrandbits(32), frame.rkey ^ (1 << rng.randrange(32)), 0, M32,
                regions["gone"].rkey, regions["local"].rkey, regions["r"].rkey, frame.rkey + 1,
            ]
        )  # fmt: skip
        frame.span = None
    elif kind == "bounds":
        region, n = regions[rng.choice(["rw", "w"])], frame.length
        frame.addr = rng.choice(
            [
                max(0, region.addr - rng.randint(1, n)),  # crosses the start
                region.end - rng.randint(0, n - 1),  # crosses the end
                region.end + rng.randint(0, 8192),  # past the end (the guard, the next region)
                region.addr - n - rng.randint(0, 1000),  # before the start
                0, M64 - n + 1, M64, rng.getrandbits(64),  # addr + length overflows 64 bits
            ]
        )  # fmt: skip
        frame.span = None
    elif kind == "span":  # the frame lies in the region, its run does not
        region = regions["rw"] if frame.rkey == regions["rw"].rkey else regions["w"]
        lo, hi = frame.span or (frame.addr, frame.length)
        hi += lo
        choice = rng.randrange(3)
        if choice == 0:
            lo = region.addr - rng.randint(1, 4096)
        elif choice == 1:
            hi = region.end + rng.randint(1, 4096)
        frame.span = (lo, M64 - lo if choice == 2 else hi - lo)
    elif kind == "access":  # a region that exists, in bounds, without write access
        name = rng.choice(["r", "local"])
        frame.addr, length = arena.span_in(rng, name, 2048)
        frame.rkey, frame.length, frame.span = regions[name].rkey, length, None
        frame.payload = rng.randbytes(length)
    elif kind == "imm_flags":
        frame.imm = rng.choice([0, M32, rng.getrandbits(32)])
        frame.flags = rng.getrandbits(16)
    elif kind == "drain":  # a refused frame whose payload takes more than one drain buffer
        frame.rkey, frame.span = rng.getrandbits(32) | 1 << 31, None
        frame.length = rng.randint(64 << 10, (1 << 20) + (200 << 10))
        frame.payload = rng.randbytes(frame.length)
    return frame


def hard_tail(rng: random.Random, arena: Arena, seq: int) -> tuple[str, bytes]:
    """The last bytes of a connection: a valid write at ``seq`` with one thing broken."""
    frame = valid_write(rng, arena, seq)
    n = frame.length
    kind = rng.choice(HARD_KINDS)
    if kind == "magic":
        frame.magic = rng.choice([b"KVMA", b"KVMH", b"\0\0\0\0", rng.randbytes(4)])
    elif kind == "version":
        frame.version = rng.choice([0, 2, M8, rng.getrandbits(8)])
    elif kind == "op":
        frame.op = rng.choice([0, 3, M8, rng.getrandbits(8)])
    elif kind == "length":
        frame.length = rng.choice(
            [0, -1, MAX_FRAME_BYTES + 1, 1 << 63, M64, n - 1, n + 1, 2 * n, rng.getrandbits(64)]
        )
    elif kind == "addr":
        frame.addr = rng.choice([frame.addr + rng.randint(-64, 64), -1, 0, rng.getrandbits(64)])
    elif kind == "span":
        span_addr, span_len = frame.span or (frame.addr, n)
        if rng.random() < 0.5:
            span_addr = rng.choice([span_addr + 1, span_addr - 1, 0, -1, rng.getrandbits(64)])
        else:
            span_len = rng.choice([0, span_len - 1, -1, rng.getrandbits(64)])
        frame.span = (span_addr, span_len)
    elif kind == "index":
        frame.idx, frame.count = rng.choice(
            [(1, 1), (0, 0), (5, 2), (M32, M32), (0, 2), (0, M32), (rng.getrandbits(32), 1)]
        )
    elif kind == "seq":
        frame.seq = rng.choice(
            [0, seq - 1, seq + 1, seq + MAX_PENDING_WRITES, seq + MAX_PENDING_WRITES - 1, -1,
             rng.getrandbits(64)]
        )  # fmt: skip
    wire = frame.wire()
    if kind == "truncate":
        wire = wire[: rng.randrange(1, len(wire))]
    elif kind == "bits":
        wire = flip_bits(rng, wire, FRAME.size if rng.random() < 0.7 else len(wire))
    elif kind == "garbage":
        wire = rng.randbytes(rng.randint(1, 512))
    return kind, wire


@dataclass
class TcpConnection:
    """One connection's bytes and what the receiver must do with them."""

    kind: str
    hello: Hello  # answers the receiver's challenge
    stream: bytearray  # what follows the hello
    answers: bytearray = field(default_factory=bytearray)  # exact ACKs/NAKs of the soft frames
    completions: list[tuple[int, str, int]] = field(default_factory=list)
    refused: int = 0  # refusals of soft frames
    tail: Walk = field(default_factory=Walk)
    frames: int = 0
    valid: int = 0


def soft_effect(conn: TcpConnection, frame: TcpFrame, arena: Arena, peer: str) -> bool:
    """Append a soft frame; book the answer, completion and placement due to it. Returns whether
    it is a write (it then takes a sequence number)."""
    header = frame.header()  # what the receiver sees: every field modulo its width
    fields = FRAME.unpack(header)
    assert frame_ok(fields), f"soft frame {frame} would close the connection"
    _, _, op, flags, rkey, imm, addr, length, seq, idx, _, span, span_len = fields
    access = Access.REMOTE_READ if op == OP_READ else Access.REMOTE_WRITE
    status = arena.refusal(rkey, span, span_len, access)
    conn.stream += frame.wire()
    conn.frames += 1
    conn.valid += not status
    conn.refused += bool(status)
    if op == OP_READ:
        if status:
            conn.answers += ACK.pack(MAGIC_ACK, status, OP_READ, 0, idx, seq, 0)
        else:
            conn.answers += ACK.pack(MAGIC_ACK, 0, OP_READ, 0, idx, seq, length)
            conn.answers += arena.read(addr, length)
        return False
    if not status:
        arena.write(addr, frame.payload)
        conn.completions.append((imm, peer, length))
    if status or not flags & FLAG_NO_ACK:
        conn.answers += ACK.pack(MAGIC_ACK, status, OP_WRITE, 0, idx, seq, length)
    return True


def tcp_session(rng: random.Random, arena: Arena, secret: bytes) -> TcpConnection:
    """A good hello, soft frames, and (most often) a hard tail."""
    peer = rng.choice([rng.randbytes(rng.randint(1, 256)), b"fuzz-%d" % rng.getrandbits(20)])
    endpoint_id = rng.getrandbits(64)
    conn = TcpConnection(
        "session", lambda ch: tcp_hello(secret, ch, peer, endpoint_id), bytearray()
    )
    conn.answers += ACCEPT  # the receiver admits the lane first
    name = peer.decode(errors="replace")
    seq = 1
    for _ in range(rng.randint(1, 40)):
        kind = rng.choices(SOFT_KINDS, SOFT_WEIGHTS)[0]
        seq += soft_effect(conn, soft_frame(rng, arena, seq, kind), arena, name)
    if rng.random() < 0.75:
        conn.kind, tail = hard_tail(rng, arena, seq)
        conn.stream += tail
        conn.frames += 1
        conn.tail = walk_frames(tail, arena)
    return conn


def tcp_bad_hello(rng: random.Random, arena: Arena, secret: bytes) -> TcpConnection:
    """A hello with one thing wrong (a proof made with another secret, a broken field, a cut),
    then valid frames: the receiver must hang up and act on none of them."""
    peer = b"fuzz-%d" % rng.getrandbits(20)
    endpoint_id = rng.getrandbits(64)
    kind = rng.choice(
        ["secret", "magic", "version", "n_zero", "n_big", "n_short", "n_long", "cut", "bits"]
    )

    def hello(challenge: bytes) -> bytes:
        if kind == "secret":
            return tcp_hello(rng.randbytes(32), challenge, peer, endpoint_id)
        good = tcp_hello(secret, challenge, peer, endpoint_id)
        if kind == "magic":
            return rng.choice([b"KVMF", rng.randbytes(4)]) + good[4:]
        if kind == "version":
            return good[:4] + rng.choice([0, 1, 3, M16]).to_bytes(2, "little") + good[6:]
        if kind.startswith("n_"):
            n = {
                "n_zero": 0,
                "n_big": rng.randint(257, M16),
                "n_short": rng.randint(1, len(peer) - 1),
                "n_long": rng.randint(len(peer) + 1, 256),
            }[kind]
            return tcp_hello(secret, challenge, peer, endpoint_id, n)
        if kind == "cut":
            return good[: rng.randrange(1, len(good))]
        return flip_bits(rng, good, HELLO.size)

    stream = bytearray()
    for seq in range(1, rng.randint(1, 5)):
        stream += valid_write(rng, arena, seq).wire()
    return TcpConnection(f"hello-{kind}", hello, stream, frames=1)


def tcp_garbage(rng: random.Random, arena: Arena, secret: bytes) -> TcpConnection:
    garbage = rng.randbytes(rng.randint(1, 4096))
    return TcpConnection("garbage", lambda _: garbage, bytearray(), frames=1)


def check_tcp_connection(
    conn: TcpConnection,
    answers: bytes,
    reset: bool,
    got: list[tuple[int, str, int]],
    delta: tuple[int, int],
    arena: Arena,
    ctx: str,
) -> None:
    """The receiver's answers, completions, counters and memory after one connection."""
    n = min(len(answers), len(conn.answers))
    if answers[:n] != conn.answers[:n]:
        at = next(i for i in range(n) if answers[i] != conn.answers[i])
        raise AssertionError(fail(ctx, f"ACK/NAK stream differs from the reference at byte {at}"))
    assert reset or len(answers) >= len(conn.answers), fail(ctx, "soft frames left unanswered")
    k = len(conn.completions)
    assert got[:k] == conn.completions, fail(ctx, f"completions {got[:k]} != {conn.completions}")
    extra = got[k:]
    tail_imms = {imm for _, _, imm in conn.tail.writes}
    assert len(extra) <= len(conn.tail.writes), fail(ctx, f"unexpected completions {extra}")
    assert all(imm in tail_imms for imm, _, _ in extra), fail(ctx, f"stray completions {extra}")
    writes, refused = delta
    assert writes == len(got), fail(ctx, f"{writes} writes counted, {len(got)} completed")
    assert conn.refused <= refused <= conn.refused + conn.tail.frames, fail(
        ctx, f"{refused} refusals counted, {conn.refused} soft frames refused"
    )
    for addr, length, _ in conn.tail.writes:
        arena.allow(addr, length)
    arena.settle(ctx)


async def tcp_round(rx: TcpTransport, conn: TcpConnection, arena: Arena, ctx: str) -> bool:
    """Run one connection against the receiver and check what it did; returns whether the
    connection ended with a reset."""
    before = rx.stats()
    address = ("127.0.0.1", rx.port)
    answers, reset = await round_trip(socket.AF_INET, address, bytes(conn.stream), ctx, conn.hello)
    got = drain(rx.completion_queue)
    after = rx.stats()
    delta = (after.writes - before.writes, after.refused - before.refused)
    check_tcp_connection(conn, answers, reset, got, delta, arena, ctx)
    return reset


async def endpoint_write(
    ep: Endpoint,
    local: MemoryRegion,
    src: torch.Tensor,
    rng: random.Random,
    arena: Arena,
    queue: CompletionQueue,
    peer: str,
    ctx: str,
) -> None:
    """A real endpoint's valid write (several frames over several lanes) lands and completes."""
    name = rng.choice(["rw", "w"])
    addr, length = arena.span_in(rng, name, arena.regions[name].length)
    offset = rng.randrange(local.length - length + 1)
    imm = rng.getrandbits(32)
    entry = WriteEntry(local, offset, addr, arena.regions[name].rkey, length)
    await asyncio.wait_for(ep.write([entry], imm), 10)
    arena.write(addr, src[offset : offset + length].numpy().tobytes())
    assert drain(queue) == [(imm, peer, length)], fail(ctx, "the endpoint's write did not complete")
    arena.settle(ctx)


@dataclass
class Tally:
    valid: int = 0
    refused: int = 0
    hard: int = 0
    connections: int = 0
    resets: int = 0
    endpoint_writes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def frames(self) -> int:
        return self.valid + self.refused + self.hard

    def add(self, conn: TcpConnection, reset: bool) -> None:
        self.connections += 1
        self.resets += reset
        self.valid += conn.valid
        self.refused += conn.refused
        self.hard += conn.kind != "session"
        self.kinds[conn.kind] = self.kinds.get(conn.kind, 0) + 1


@pytest.mark.slow  # seconds: left out of make test-fast
async def test_tcp_receiver_survives_fuzzed_frames_with_guards_and_untouched_bytes_intact() -> None:
    """At least FRAMES_PER_TRANSPORT frames against one tcp receiver (see the module doc)."""
    rng = random.Random(SEED)
    started = time.monotonic()
    async with (
        TcpTransport(RX_CONFIG) as rx,
        TcpTransport(TransportConfig(peer_id="fuzz-tx", tcp_slice_bytes=4096)) as tx,
    ):
        arena = Arena(rx, rng)
        secret = rx._secret
        src = torch.randint(0, 256, (32 << 10,), dtype=torch.uint8, generator=torch.Generator())
        local = tx.register(src)
        threads, fds = transport_threads(), open_fds()
        tally = Tally()
        ep = await tx.connect(rx.descriptor())
        while tally.frames < FRAMES_PER_TRANSPORT:
            roll = rng.random()
            make = tcp_session if roll < 0.86 else tcp_bad_hello if roll < 0.94 else tcp_garbage
            conn = make(rng, arena, secret)
            ctx = f"tcp connection {tally.connections} ({conn.kind}), frames {tally.frames}-"
            ctx += f"{tally.frames + conn.frames - 1}"
            tally.add(conn, await tcp_round(rx, conn, arena, ctx))
            if tally.connections % 16 == 0:  # valid writes interleaved with the garbage
                await endpoint_write(
                    ep, local, src, rng, arena, rx.completion_queue, tx.peer_id, ctx
                )
                tally.endpoint_writes += 1
        await ep.aclose()
        ctx = "after the campaign"
        # the receiver is alive: a fresh endpoint's write lands where it should, and only there
        async with await tx.connect(rx.descriptor()) as fresh:
            await endpoint_write(fresh, local, src, rng, arena, rx.completion_queue, "fuzz-tx", ctx)
        assert arena.guards_intact(), fail(ctx, "guard bytes changed")
        stats = rx.stats()
        assert stats.refused >= tally.refused, fail(ctx, f"{stats.refused} refusals counted")
        assert rx._server is not None
        await assert_no_leaks(rx._server, threads, fds, tally.connections)
        assert not rx._peers, fail(ctx, f"receiver still holds peer state {list(rx._peers)}")
    elapsed = time.monotonic() - started
    print(
        f"\ntcp fuzz seed={SEED:#x}: {tally.frames} frames ({tally.valid} valid, {tally.refused} "
        f"refused, {tally.hard} hard) over {tally.connections} connections ({tally.resets} reset), "
        f"{tally.endpoint_writes} endpoint writes, {stats.refused} refusals counted, "
        f"{elapsed:.1f} s; tails {dict(sorted(tally.kinds.items()))}"
    )
    assert tally.frames >= FRAMES_PER_TRANSPORT


# ---- shm: the notification stream the receiver parses --------------------------------------------


def note(
    op: int,
    reason: int = 0,
    pad: int = 0,
    imm: int = 0,
    seq: int = 0,
    nbytes: int = 0,
    rkey: int = 0,
) -> bytes:
    fields = (op & M8, reason & M8, pad & M16, imm & M32, rkey & M32, seq & M64, nbytes & M64)
    return NOTE.pack(*fields)


@dataclass
class NoteEffects:
    """What a notification stream makes the receiver count and deliver."""

    completions: list[tuple[int, str, int]] = field(default_factory=list)
    writes: int = 0
    bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    refused: int = 0
    notes: int = 0


def note_effects(data: bytes, live_key: Callable[[int], bool]) -> NoteEffects:
    """The shm receiver's parse of one connection's bytes, as a reference. A WRITE_DONE counts
    only with a key that is live for writing (``live_key``); otherwise it is refused."""
    fx = NoteEffects()
    if len(data) < NOTE.size:
        return fx
    op, _, _, _, _, _, n = NOTE.unpack_from(data)
    if op != OP_HELLO or not 0 < n <= 256 or len(data) < NOTE.size + n:
        return fx
    peer = data[NOTE.size : NOTE.size + n].decode(errors="replace")
    pos = NOTE.size + n
    while pos + NOTE.size <= len(data):
        op, _, _, imm, rkey, _, nbytes = NOTE.unpack_from(data, pos)
        pos += NOTE.size
        if op == OP_WRITE_DONE and not live_key(rkey):
            fx.refused += 1  # a forged or late immediate
        elif op == OP_WRITE_DONE:
            fx.writes, fx.bytes = fx.writes + 1, fx.bytes + nbytes
            fx.completions.append((imm, peer, nbytes))
        elif op == OP_READ_DONE:
            fx.reads, fx.read_bytes = fx.reads + 1, fx.read_bytes + nbytes
        elif op == OP_REFUSED:
            fx.refused += 1
        else:
            break
        fx.notes += 1
    return fx


def random_note(rng: random.Random, keys: Sequence[int]) -> bytes:
    nbytes = rng.choice([0, 1, M64, rng.getrandbits(64), rng.getrandbits(20)])
    op = rng.choice([OP_WRITE_DONE, OP_WRITE_DONE, OP_READ_DONE, OP_REFUSED])
    reason = rng.choice([*(int(r) for r in RefusalReason), 0, M8, rng.getrandbits(8)])
    rkey = rng.choice([*keys, *keys, 0, rng.getrandbits(32)])  # live keys, and dead or forged
    imm, seq = rng.getrandbits(32), rng.getrandbits(64)
    return note(op, reason, rng.getrandbits(16), imm, seq, nbytes, rkey)


def shm_connection(rng: random.Random, keys: Sequence[int]) -> tuple[str, bytes, int]:
    """(kind, bytes, notes sent): a session of notes with a broken tail, a broken hello, or
    garbage."""
    peer = rng.choice([rng.randbytes(rng.randint(1, 256)), b"fuzz-%d" % rng.getrandbits(20)])
    hello = note(OP_HELLO, rng.getrandbits(8), rng.getrandbits(16), rng.getrandbits(32),
                 rng.getrandbits(64), len(peer)) + peer  # fmt: skip
    roll = rng.random()
    if roll < 0.06:
        return "garbage", rng.randbytes(rng.randint(1, 2048)), 1
    notes = [random_note(rng, keys) for _ in range(rng.randint(1, 60))]
    if roll < 0.14:  # a broken hello, then notes the receiver must ignore
        kind = rng.choice(["op", "n_zero", "n_big", "n_long", "cut", "bits"])
        if kind == "op":
            hello = note(rng.randint(1, M8), nbytes=len(peer)) + peer
        elif kind == "n_zero":
            hello = note(OP_HELLO, nbytes=0) + peer
        elif kind == "n_big":
            hello = note(OP_HELLO, nbytes=rng.choice([257, M64, rng.getrandbits(64)])) + peer
        elif kind == "n_long":
            hello = note(OP_HELLO, nbytes=rng.randint(len(peer) + 1, 256)) + peer
        elif kind == "cut":
            hello = hello[: rng.randrange(1, len(hello))]
        else:
            hello = flip_bits(rng, hello, NOTE.size)
        return f"hello-{kind}", hello + b"".join(notes), len(notes) + 1
    tail_kind = rng.choice(["none", "op", "hello", "cut", "bits", "garbage"])
    tail = {
        "none": b"",
        "op": note(rng.choice([0, 4, M8, rng.randint(4, M8)])),
        "hello": note(OP_HELLO, nbytes=4) + b"late",
        "cut": random_note(rng, keys)[: rng.randrange(1, NOTE.size)],
        "bits": flip_bits(rng, random_note(rng, keys), NOTE.size),
        "garbage": rng.randbytes(rng.randint(1, 512)),
    }[tail_kind]
    return f"tail-{tail_kind}", hello + b"".join(notes) + tail, len(notes) + bool(tail)


def fuzzed_entry(rng: random.Random, arena: Arena, local: MemoryRegion) -> WriteEntry:
    """A write entry for an shm writer: valid, or with its rkey, address or length broken."""
    name = rng.choice(["rw", "w"])
    region = arena.regions[name]
    addr, length = arena.span_in(rng, name, 4096)
    rkey, roll = region.rkey, rng.random()
    if roll < 0.15:
        rkey = rng.choice(
            [
                rng.getrandbits(32), 0, M32, -1, 1 << 40, arena.regions["gone"].rkey,
                arena.regions["local"].rkey, arena.regions["r"].rkey, rkey ^ 1,
            ]
        )  # fmt: skip
    elif roll < 0.3:
        addr = rng.choice(
            [
                region.addr - rng.randint(1, length), region.end - rng.randint(0, length - 1),
                region.end + rng.randint(0, 4096), 0, -1, -(1 << 63), M64, rng.getrandbits(64),
            ]
        )  # fmt: skip
    elif roll < 0.4:
        length = rng.randint(region.length + 1, local.length)
        addr = region.addr + rng.randint(-64, 64)
    offset = rng.randrange(local.length - length + 1)
    return WriteEntry(local, offset, addr, rkey, length)


def first_refusal(arena: Arena, entries: list[WriteEntry]) -> int:
    """The reason an shm writer refuses a write for (its first bad entry's), or 0."""
    for e in entries:
        status = arena.refusal(e.rkey, e.remote_addr, e.length, Access.REMOTE_WRITE)
        if status:
            return status
    return 0


def source_bytes(src: torch.Tensor, entry: WriteEntry) -> bytes:
    return src[entry.local_offset : entry.local_offset + entry.length].numpy().tobytes()


async def shm_round(rx: ShmTransport, data: bytes, ctx: str) -> None:
    """Run one notification connection; the receiver must count and deliver exactly what the
    reference parse says, and answer nothing."""
    live = lambda rkey: rx._registry.is_live_key(rkey, Access.REMOTE_WRITE)
    expect, before = note_effects(data, live), counters(rx.stats())
    answers, _ = await round_trip(socket.AF_UNIX, rx.socket_path, data, ctx)
    delta = tuple(counters(rx.stats()) - before)
    assert answers == b"", fail(ctx, "the notification socket answered")
    assert drain(rx.completion_queue) == expect.completions, fail(ctx, "completions differ")
    want = (expect.writes, expect.bytes, expect.reads, expect.read_bytes, expect.refused)
    assert delta == want, fail(ctx, f"counters moved by {delta}, expected {want}")


async def shm_fuzzed_writes(
    ep: Endpoint,
    rng: random.Random,
    arena: Arena,
    local: MemoryRegion,
    src: torch.Tensor,
    rx: ShmTransport,
    peer: str,
    ctx: str,
) -> tuple[int, int]:
    """A few writes with fuzzed entries through a real shm endpoint: a write with one bad entry
    is refused whole (nothing copied) and counted by the receiver; (valid, refused)."""
    before = rx.stats()
    completions, refused = [], 0
    for _ in range(rng.randint(1, 6)):
        entries = [fuzzed_entry(rng, arena, local) for _ in range(rng.randint(1, 3))]
        status = first_refusal(arena, entries)
        imm = rng.getrandbits(32)
        try:
            await asyncio.wait_for(ep.write(entries, imm), 10)
        except RemoteAccessError as exc:
            assert exc.reason == status, fail(ctx, f"refused {exc.reason!r}, expected {status}")
            refused += 1
            continue
        assert not status, fail(ctx, f"a write with a bad entry ({status}) was placed")
        for e in entries:
            arena.write(e.remote_addr, source_bytes(src, e))
        completions.append((imm, peer, sum(e.length for e in entries)))
    arena.settle(ctx)
    want = (before.writes + len(completions), before.refused + refused)
    await wait_until(lambda: (rx.stats().writes, rx.stats().refused) == want, f"{ctx}: counters")
    assert drain(rx.completion_queue) == completions, fail(ctx, "endpoint completions differ")
    return len(completions), refused


async def test_shm_receiver_survives_fuzzed_notes_and_writers_refuse_fuzzed_entries() -> None:
    """At least FRAMES_PER_TRANSPORT notes against one shm receiver's notification socket, with
    writes of fuzzed entries through a real endpoint in between (see the module doc)."""
    rng = random.Random(SEED + 1)
    started = time.monotonic()
    async with (
        ShmTransport(RX_CONFIG) as rx,
        ShmTransport(TransportConfig(peer_id="fuzz-tx")) as tx,
    ):
        arena = Arena(rx, rng)
        src = torch.randint(0, 256, (32 << 10,), dtype=torch.uint8, generator=torch.Generator())
        local = tx.register(src)
        threads, fds = transport_threads(), open_fds()
        notes = connections = ep_valid = ep_refused = 0
        kinds: dict[str, int] = {}
        ep = await tx.connect(rx.descriptor())
        while notes < FRAMES_PER_TRANSPORT:
            keys = [region.rkey for region in arena.regions.values()]
            kind, data, sent = shm_connection(rng, keys)
            ctx = f"shm connection {connections} ({kind}), notes {notes}-{notes + sent - 1}"
            await shm_round(rx, data, ctx)
            notes += sent
            connections += 1
            kinds[kind] = kinds.get(kind, 0) + 1
            if rng.random() < 0.5:  # writes through a real endpoint between the garbage
                valid, refused = await shm_fuzzed_writes(
                    ep, rng, arena, local, src, rx, "fuzz-tx", ctx
                )
                ep_valid, ep_refused = ep_valid + valid, ep_refused + refused
        await ep.aclose()
        ctx = "after the campaign"
        async with await tx.connect(rx.descriptor()) as fresh:
            region = arena.regions["w"]
            entry = WriteEntry(local, 5, region.addr, region.rkey, region.length)
            await asyncio.wait_for(fresh.write([entry], 77), 10)
            arena.write(region.addr, source_bytes(src, entry))
            arena.settle(ctx)
            await wait_until(
                lambda: rx.completion_queue.qsize() == 1, "the fresh write's completion"
            )
            assert drain(rx.completion_queue) == [(77, "fuzz-tx", region.length)]
        assert arena.guards_intact(), fail(ctx, "guard bytes changed")
        stats = rx.stats()
        assert stats.refused >= ep_refused > 0, fail(ctx, f"{stats.refused} refusals counted")
        assert rx._server is not None
        await assert_no_leaks(rx._server, threads, fds, connections)
    elapsed = time.monotonic() - started
    print(
        f"\nshm fuzz seed={SEED:#x}: {notes} notes over {connections} connections, "
        f"{ep_valid + ep_refused} fuzzed endpoint writes ({ep_refused} refused), "
        f"{stats.refused} refusals counted, {elapsed:.1f} s; kinds {dict(sorted(kinds.items()))}"
    )


# ---- shm: the region table rows a writer parses ---------------------------------------------------


def mutate_row(rng: random.Random, row: np.ndarray, token: str, spare: str) -> str:
    """Break one field of a region table row (a 1-row view) the way a corrupt or forged table
    could; returns what was done."""
    name = rng.choice(["state", "rkey", "addr", "length", "seg_offset", "access", "segment", "pad"])
    old = int(row[name][0]) if name != "segment" else 0
    if name == "state":
        value = rng.choice([FREE, RETIRED, LIVE, 3, M32, rng.getrandbits(32)])
    elif name == "rkey":
        value = rng.choice([0, M32, rng.getrandbits(32), old ^ 1])
    elif name in ("addr", "length", "seg_offset"):
        value = rng.choice(
            [old + rng.randint(-4096, 4096), old + rng.randint(1, 1 << 20), 0, M64, old * 2,
             rng.getrandbits(64), rng.getrandbits(16)]
        ) & M64  # fmt: skip
    elif name == "access":
        value = rng.choice([0, int(Access.REMOTE_READ), M32, rng.getrandbits(32)])
    elif name == "pad":
        value = rng.getrandbits(32)
    else:
        segment = rng.choice(
            [
                spare,
                f"{token}-table",
                f"{token}-999",
                f"{token}-0/../x",
                "kvmesh-1-deadbeef-0",
                "../../etc/passwd",
                "",
                f"{token}-0\xff",
                rng.randbytes(64),
            ]
        )
        row["segment"] = segment if isinstance(segment, bytes) else segment.encode()
        return f"segment={row['segment'][0]!r}"
    row[name] = value
    return f"{name}={value:#x}"


@dataclass
class RowTarget:
    """Where a write through a row lands by the row's own word: segment name and offset."""

    segment: str
    start: int


def row_target(table: np.ndarray, rkey: int, addr: int) -> RowTarget | None:
    """The placement the first live row of ``rkey`` claims for ``addr`` (None: no live row)."""
    live = np.flatnonzero((table["rkey"] == rkey) & (table["state"] == LIVE))
    if live.size == 0:
        return None
    row = table[int(live[0])]
    name = bytes(row["segment"]).rstrip(b"\0").decode(errors="replace")
    return RowTarget(name, int(row["seg_offset"]) + addr - int(row["addr"]))


def row_entry(
    rng: random.Random, table: np.ndarray, slot: int, local: MemoryRegion
) -> tuple[int, int, int]:
    """(rkey, addr, length) aimed inside what the (mutated) row claims, where it claims any."""
    row = table[slot]
    size = int(row["length"])
    length = min(random_length(rng, 8192), local.length, max(1, size))
    offset = rng.randrange(max(1, min(size, 1 << 16) - length + 1))
    return int(row["rkey"]), int(row["addr"]) + offset, length


async def through_row(ep: Endpoint, entry: WriteEntry, read: bool, imm: int, ctx: str) -> bool:
    """Write (or read) one entry; True if done, False if refused with a TransportError."""
    try:
        op = ep.read([entry]) if read else ep.write([entry], imm)
        await asyncio.wait_for(op, 10)
    except TransportError:
        return False
    except Exception as exc:
        raise AssertionError(fail(ctx, f"the writer raised {exc!r}")) from exc
    return True


def check_placement(
    target: RowTarget | None, segments: dict[str, np.ndarray], length: int, ctx: str
) -> slice:
    """The bytes of ``target.segment`` an accepted write through a row covered: whole, inside
    a data segment."""
    assert target is not None and target.segment in segments, fail(
        ctx, f"a write was placed through a row naming {target}"
    )
    size = segments[target.segment].size
    assert target.start >= 0 and target.start + length <= size, fail(
        ctx, f"placed at [{target.start}, +{length}) of a {size}-byte segment"
    )
    return slice(target.start, target.start + length)


async def test_shm_writer_places_or_refuses_per_fuzzed_region_table_rows() -> None:
    """A writer trusts a row's word on where a region lives, but nothing more: a write it
    accepts lands whole where the row says, in a data segment of the table's creator; anything
    else (the table itself, past a segment's end, another transport) is refused with a
    TransportError and changes nothing."""
    rng = random.Random(SEED + 2)
    async with (
        ShmTransport(RX_CONFIG) as rx,
        ShmTransport(TransportConfig(peer_id="fuzz-tx")) as tx,
    ):
        arena = Arena(rx, rng)
        rx.allocate(3 * 4096 + 7)  # a second data segment a row may name
        assert rx._table is not None and rx._table_seg is not None
        table, token = rx._table, rx._token
        segments = {seg.name: seg.tensor.numpy() for seg in rx._segments}
        spare = rx._segments[1].name
        watched = {**segments, "table": rx._table_seg.tensor.numpy()}
        src = torch.randint(0, 256, (16 << 10,), dtype=torch.uint8, generator=torch.Generator())
        dst = torch.zeros(16 << 10, dtype=torch.uint8)
        local, local_dst = tx.register(src), tx.register(dst)
        slots = [
            int(np.flatnonzero(table["rkey"] == arena.regions[n].rkey)[0])
            for n in ("rw", "w", "r", "gone")
        ]
        placed = refused = 0
        async with await tx.connect(rx.descriptor()) as ep:
            for trial in range(TABLE_TRIALS):
                slot = rng.choice(slots)
                saved = table[slot].copy()
                before = {name: mem.copy() for name, mem in watched.items()}
                what = mutate_row(rng, table[slot : slot + 1], token, spare)
                ctx = f"table trial {trial}: row {slot} {what}"
                rkey, addr, length = row_entry(rng, table, slot, local)
                target = row_target(table, rkey, addr)
                read = rng.random() < 0.2
                dst.zero_()
                entry = WriteEntry(local_dst if read else local, 0, addr, rkey, length)
                try:
                    ok = await through_row(ep, entry, read, trial, ctx)
                finally:
                    table[slot] = saved
                placed, refused = placed + ok, refused + (not ok)
                if ok:
                    span = check_placement(target, segments, length, ctx)
                    assert target is not None
                    seg = before[target.segment]
                    if read:
                        assert np.array_equal(dst[:length].numpy(), seg[span]), fail(ctx, "read")
                    else:
                        seg[span] = src[:length].numpy()  # the one change allowed
                for name, mem in watched.items():
                    bad = np.flatnonzero(mem != before[name])
                    assert bad.size == 0, fail(
                        ctx,
                        f"{'placed' if ok else 'refused'}: {bad.size} bytes of {name} changed "
                        f"other than by the row's word, first at {int(bad[0])}",
                    )
        drain(rx.completion_queue)
        assert placed > TABLE_TRIALS // 10 and refused > TABLE_TRIALS // 10, (placed, refused)
    print(
        f"\nshm table fuzz seed={SEED:#x}: {TABLE_TRIALS} rows, {placed} placed, {refused} refused"
    )


# ---- regressions: what the campaign found ---------------------------------------------------------


async def shm_pair_with_region() -> tuple[ShmTransport, ShmTransport, torch.Tensor, MemoryRegion]:
    """A receiver and a writer; the receiver's 4 KiB region as the writer reaches it (through
    a window: its key names the window's table row)."""
    rx, tx = ShmTransport(TransportConfig()), ShmTransport(TransportConfig())
    await rx.start()
    await tx.start()
    mem = rx.allocate(4096)
    region = rx.register(mem, Access.REMOTE_WRITE)
    window = rx.open_window(region, [(region.addr, region.length)])
    return rx, tx, mem, msgspec.structs.replace(region, rkey=window.rkey)


@pytest.mark.parametrize(
    ("field_name", "value"), [("seg_offset", 1 << 40), ("seg_offset", 4095), ("length", 1 << 20)]
)
async def test_shm_writer_refuses_a_table_row_pointing_past_its_segment(
    field_name: str, value: int
) -> None:
    """Found by the table campaign: the writer sliced the mapping past its end (torch clamps),
    then raised RuntimeError, or placed nothing and still reported the write done."""
    rx, tx, mem, region = await shm_pair_with_region()
    try:
        assert rx._table is not None
        rx._table[field_name][rx._window_slots[region.rkey][0]] = value
        length = 2 if field_name == "seg_offset" else 8192
        src = tx.register(torch.full((length,), 9, dtype=torch.uint8))
        async with await tx.connect(rx.descriptor()) as ep:
            with pytest.raises(UntrustedDescriptorError, match="past the end of segment"):
                await ep.write([WriteEntry(src, 0, region.addr, region.rkey, length)], 1)
        assert int(mem.sum()) == 0
        assert rx.completion_queue.get_nowait() is None
    finally:
        await tx.aclose()
        await rx.aclose()


async def test_shm_writer_refuses_a_table_row_naming_the_table_itself() -> None:
    """Found by the table campaign: a row naming ``<token>-table`` passed the name and token
    checks, so the writer copied its payload into the receiver's region table."""
    rx, tx, _, region = await shm_pair_with_region()
    try:
        assert rx._table is not None and rx._table_seg is not None
        slot = rx._window_slots[region.rkey][0]
        rx._table["segment"][slot] = rx._table_seg.name.encode()
        rx._table["seg_offset"][slot] = 0
        table_before = rx._table_seg.tensor.clone()
        src = tx.register(torch.full((64,), 0xEE, dtype=torch.uint8))
        async with await tx.connect(rx.descriptor()) as ep:
            with pytest.raises(UntrustedDescriptorError, match="its table"):
                await ep.write([WriteEntry(src, 0, region.addr, region.rkey, 64)], 1)
        assert torch.equal(rx._table_seg.tensor, table_before)
    finally:
        await tx.aclose()
        await rx.aclose()


async def test_shm_writer_refuses_rkey_zero_as_unknown_not_deregistered() -> None:
    """Found by the entry campaign: never-used table slots hold rkey 0, so a write to rkey 0
    was refused as DEREGISTERED (whose hint says to fetch a fresh descriptor)."""
    rx, tx, _, _ = await shm_pair_with_region()
    try:
        src = tx.register(torch.ones(16, dtype=torch.uint8))
        async with await tx.connect(rx.descriptor()) as ep:
            with pytest.raises(RemoteAccessError) as info:
                await ep.write([WriteEntry(src, 0, 0x1000, 0, 16)], 1)
        assert info.value.cause == RefusalReason.UNKNOWN_RKEY
    finally:
        await tx.aclose()
        await rx.aclose()
