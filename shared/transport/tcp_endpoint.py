"""Writer side of the tcp backend: one endpoint = several lanes (sockets) to one receiver.

Per lane a sender thread (``sendmsg`` headers + payload pieces) and an ACK thread (``recv_into``),
in ``tcp_lane``. ``write`` cuts entries into frames (``tcp_frames``) and queues them all at once;
window credit is taken by the send thread and returned by the ACK thread, so the data path never
waits on the event loop, which only hears of an operation when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.kv.imm import check_imm
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import lane_auth, unix_lanes
from kvmesh.shared.transport.backend import EndpointBase
from kvmesh.shared.transport.backoff import RETRIABLE, Backoff
from kvmesh.shared.transport.base import WriteEntry
from kvmesh.shared.transport.errors import (
    PeerGoneError,
    PeerUnreachableError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
    TransportError,
)
from kvmesh.shared.transport.server import recv_exact
from kvmesh.shared.transport.tcp import MAX_PENDING_WRITES, OP_READ, OP_WRITE, tune
from kvmesh.shared.transport.tcp_frames import Frame, Op, cut_frames
from kvmesh.shared.transport.tcp_lane import Lane, ack_loop, send_loop
from kvmesh.shared.transport.threads import ThreadSet

if TYPE_CHECKING:
    from kvmesh.shared.transport.tcp import TcpTransport

log = logs.get_logger(__name__)


def _background(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Waits run to their end even if the caller is cancelled (callers await them shielded), so a
    timeout still closes the endpoint and later writes still wait for earlier ones."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


# where a lane connects: (host, port) over TCP, or a same-host unix socket's path (unix_lanes)
Address = tuple[str, int] | str


def _connect(address: Address, timeout_s: float) -> socket.socket:
    if isinstance(address, tuple):
        return socket.create_connection(address, timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _open_lane(
    address: Address,
    timeout_s: float,
    secret: bytes,
    hello: tuple[int, int, int, str],
) -> socket.socket:
    """Connect one lane and prove it belongs to the mesh (``lane_auth``): read the receiver's
    challenge, answer it, wait for its acceptance. A receiver that hangs up instead refused
    the hello (a stale descriptor's secret, it is at a connection limit, or under a flood): a
    hang-up is a ConnectionResetError, which the caller tries again (``backoff``)."""
    sock = _connect(address, timeout_s)
    try:
        challenge = bytearray(lane_auth.CHALLENGE.size)
        if recv_exact(sock, memoryview(challenge)) != len(challenge):
            raise ConnectionResetError("the receiver hung up before its challenge")
        sock.sendall(lane_auth.answer_challenge(secret, bytes(challenge), *hello))
        accept = bytearray(len(lane_auth.ACCEPT))
        if recv_exact(sock, memoryview(accept)) != len(accept):
            raise ConnectionResetError(
                "the receiver refused this lane (it hung up after the hello: the descriptor's "
                "secret is stale, or the receiver is at its connection limit)"
            )
        if accept != lane_auth.ACCEPT:
            raise OSError(f"the receiver answered the hello with {bytes(accept)!r}, not ACCEPT")
        sock.settimeout(None)
        tune(sock)
        return sock
    except BaseException:
        sock.close()
        raise


async def _open_lane_retrying(
    address: Address,
    timeout_s: float,
    secret: bytes,
    hello: tuple[int, int, int, str],
    backoff: Backoff,
    started: float,
) -> socket.socket:
    """``_open_lane``, tried again after a reset or refusal (``backoff``) until its total time
    has passed since ``started`` (the endpoint's first try: all its lanes share one deadline);
    then the last error goes up, with the number of tries."""
    rng = random.Random()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await asyncio.to_thread(_open_lane, address, timeout_s, secret, hello)
        except RETRIABLE as exc:
            wait = backoff.delay(attempt, time.monotonic() - started, rng)
            if wait is None:
                raise type(exc)(f"{exc} ({attempt} tries in {backoff.total_s} s)") from exc
        await asyncio.sleep(wait)


class TcpEndpoint(EndpointBase):
    backend = "tcp"

    def __init__(self, transport: TcpTransport, peer_id: str, info: TcpBackend) -> None:
        super().__init__(peer_id)
        self._transport = transport
        self._address = (info.host, info.port)
        self.unix_path: str | None = None  # the same-host socket its lanes took, or None: TCP
        config = transport.config
        self._slice = config.tcp_slice_bytes
        # the bytes `tcp_window` full slices hold: smaller frames do not shrink the window
        self._window_bytes = config.tcp_window * config.tcp_slice_bytes
        self._op_timeout_s = config.op_timeout_s
        self._lanes: list[Lane] = []
        self._threads = ThreadSet()
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # op.remaining / op.error, settled from every ACK thread
        self._ops: set[Op] = set()
        self._write_seq = self._read_seq = 0
        # writes in flight, below the receiver's cap on half-finished writes per connection
        self._write_slots = asyncio.Semaphore(MAX_PENDING_WRITES)
        self._last_write: asyncio.Task[None] | None = None
        self._broken: TransportError | None = None

    @classmethod
    async def open(cls, transport: TcpTransport, descriptor: TransportDescriptor) -> TcpEndpoint:
        info = transport.peer_part(descriptor)
        try:
            secret = lane_auth.parse_secret(info.secret)
        except ValueError as exc:
            raise PeerUnreachableError(f"tcp peer {descriptor.peer_id}: {exc}") from None
        ep = cls(transport, descriptor.peer_id, info)
        config = transport.config
        unix = unix_lanes.local_path(descriptor, info) if config.tcp_unix_lanes else None
        if unix is not None:  # same host: its unix socket, TCP if that fails
            try:
                await ep._open_lanes(info, secret, unix)
                ep.unix_path = unix
            except OSError as exc:
                log.info(
                    "same-host lane socket unreachable; dialing tcp", path=unix, error=str(exc)
                )
        try:
            if ep.unix_path is None:
                await ep._open_lanes(info, secret, ep._address)
        except (OSError, ValueError) as exc:
            raise PeerUnreachableError(
                f"cannot reach tcp peer {descriptor.peer_id} at {ep._address}: {exc}"
            ) from exc
        for lane in ep._lanes:
            ep._threads.spawn(
                send_loop, f"tcp-send-{lane.index}", lane, ep._lost, config.keepalive_s
            )
            ep._threads.spawn(ack_loop, f"tcp-ack-{lane.index}", lane, ep._settle, ep._lost)
        return ep

    async def _open_lanes(self, info: TcpBackend, secret: bytes, address: Address) -> None:
        """Every lane to ``address``, each retried (``backoff``) within one deadline; on an
        error, the lanes opened so far are closed."""
        transport, config = self._transport, self._transport.config
        num_lanes = max(1, min(config.tcp_lanes, info.lanes))
        endpoint_id = secrets.randbits(63)
        backoff, started = Backoff(total_s=config.connect_retry_s), time.monotonic()
        try:
            for i in range(num_lanes):
                sock = await _open_lane_retrying(
                    address, config.connect_timeout_s, secret,
                    (i, num_lanes, endpoint_id, transport.peer_id), backoff, started,
                )  # fmt: skip
                self._lanes.append(Lane(i, sock, self._window_bytes))
        except BaseException:
            for lane in self._lanes:
                lane.sock.close()
            self._lanes.clear()
            raise

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    @property
    def window_bytes(self) -> int:
        """Bytes one lane may have sent and not yet had ACKed (``tcp_window`` x slice)."""
        return self._window_bytes

    @property
    def max_in_flight(self) -> int:
        """Most frames ever in flight on one lane."""
        return max(lane.window.peak_items for lane in self._lanes)

    @property
    def max_in_flight_bytes(self) -> int:
        """Most bytes ever in flight on one lane (never above ``window_bytes``)."""
        return max(lane.window.peak_bytes for lane in self._lanes)

    async def _teardown(self) -> None:
        self._transport.forget_endpoint(self)
        self._break(TransportClosedError(f"endpoint to {self._peer_id} was closed"))
        await asyncio.to_thread(self._threads.join)
        for lane in self._lanes:
            lane.sock.close()

    # -- operations --------------------------------------------------------------------------------

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        check_imm(imm)
        frames = self._frames(entries, OP_WRITE)
        await self._write_slots.acquire()  # before the seq: seqs are posted in order
        self._write_seq += 1
        op = self._post(frames, self._write_seq, imm)
        prev = self._last_write
        task = self._last_write = _background(self._wait(op, prev))
        # The slot frees when the write settles in order (after every earlier one), not when its
        # own ACKs come: lanes ACK independently, and the receiver's window starts at the oldest
        # write it has not completed.
        task.add_done_callback(lambda _: self._write_slots.release())
        await asyncio.shield(task)

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        frames = self._frames(entries, OP_READ)
        self._read_seq += 1
        op = self._post(frames, self._read_seq, 0)
        await asyncio.shield(_background(self._wait(op, None)))

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise TransportClosedError(f"endpoint to {self._peer_id} is closed")

    def _frames(self, entries: Sequence[WriteEntry], kind: int) -> list[Frame]:
        """Cut entries into frames (``cut_frames``): at most ``slice`` bytes each."""
        self._check_open()
        return cut_frames(entries, kind, self._slice, self._transport._registry)

    def _post(self, frames: list[Frame], seq: int, imm: int) -> Op:
        """Queue every frame of one operation at once (so per-lane order is call order), each on
        the lane with the fewest outstanding bytes; the lanes' send threads pace them."""
        op = Op(self._loop.create_future(), len(frames))
        self._ops.add(op)
        count = len(frames)
        for idx, frame in enumerate(frames):
            frame.op, frame.seq, frame.idx, frame.count, frame.imm = (
                op,
                seq,
                idx,
                count,
                imm,
            )
            lane = min(self._lanes, key=lambda lane: lane.queued - lane.acked)
            lane.queued += frame.length
            lane.sends.put(frame)
        return op

    async def _wait(self, op: Op, prev: asyncio.Task[None] | None) -> None:
        """Wait for ``op``'s ACKs, then for ``prev``: a write returns only when every earlier
        write settled, so its completion is queued."""
        try:
            await asyncio.wait_for(asyncio.shield(op.future), self._op_timeout_s)
            if prev is not None:
                await asyncio.wait({prev})  # its own error went to its own caller
                self._check_open()
        except TimeoutError:
            error = PeerGoneError(
                f"tcp peer {self._peer_id} at {self._address[0]}:{self._address[1]} did not "
                f"acknowledge within {self._op_timeout_s} s (op_timeout_s); endpoint closed"
            )
            self._break(error)
            raise error from None
        finally:
            self._ops.discard(op)
            if op.future.done() and not op.future.cancelled():
                op.future.exception()  # retrieved: raised above or superseded by another error

    # -- called from lane threads ------------------------------------------------------------------

    def _settle(self, done: list[Frame], status: int) -> None:
        """Book settled frames (all placed but the last, which has ``status``)."""
        finished: list[Op] = []
        with self._lock:
            for frame in done:
                op = frame.op
                assert op is not None
                op.remaining -= 1
                if op.remaining == 0:
                    finished.append(op)
            last = done[-1]
            if status and last.op is not None and last.op.error is None:
                last.op.error = RemoteAccessError(
                    RefusalReason(status),
                    f"peer {self._peer_id}, remote addr {last.addr:#x}",
                )
        if finished:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._finish, finished)

    def _lost(self, lane: Lane, reason: str) -> None:
        error = PeerGoneError(
            f"tcp peer {self._peer_id} at {self._address[0]}:{self._address[1]} went away "
            f"(lane {lane.index}: {reason}); in-flight writes may be partially placed and are "
            "not completed on the receiver: reconnect and resend"
        )
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._break, error)

    # -- event loop --------------------------------------------------------------------------------

    def _finish(self, ops: list[Op]) -> None:
        for op in ops:
            if op.future.done():
                continue  # already failed by _break
            if op.error is None:
                op.future.set_result(None)
            else:
                op.future.set_exception(op.error)

    def _break(self, error: TransportError) -> None:
        """Fail everything in flight, stop the lanes; later calls raise ``error``."""
        if self._broken is None:
            self._broken = error
        for op in self._ops:
            if not op.future.done():
                op.future.set_exception(self._broken)
        for lane in self._lanes:
            with lane.lock:
                lane.unacked.clear()
            lane.sends.put(None)
            lane.window.close()  # wakes a send thread waiting for credit
            with contextlib.suppress(OSError):
                lane.sock.shutdown(socket.SHUT_RDWR)


__all__ = ["TcpEndpoint"]
