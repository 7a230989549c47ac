"""The rdma backend's side channel: a TCP connection beside each RC queue pair.

RC QPs are per connection pair, so connecting takes a handshake: the writer creates a QP, sends
its QP info (qpn, psn, gid, lid, mtu) in a hello to the address in the receiver's descriptor,
the receiver creates its own QP for it and answers with its info, and both sides go
INIT -> RTR -> RTS (``dial`` on the writer's side, ``SideChannelServer`` on the receiver's). The
socket stays open for the connection's life: the writer resolves window keys over it
(rdma_windows.py), and when it closes the receiver retires and destroys that QP.

Frames are a 4-byte big-endian length, then a JSON object. The receiver speaks first: a
challenge with a fresh nonce; the writer's hello carries a proof that it knows the secret in the
receiver's descriptor (``lane_auth.side_channel_proof`` over the nonce and the hello's canonical
JSON), as a tcp lane's does. A hello without a valid proof gets no QP and no answer: the
connection is closed, counted and logged (issue #27).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.kv.descriptor import RdmaBackend
from kvmesh.shared.transport import lane_auth
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import PeerUnreachableError, ProtocolError, TransportError
from kvmesh.shared.transport.rdma_connections import QPEntry, QPTable
from kvmesh.shared.transport.rdma_qp import QPInfo, qp_to_rtr, qp_to_rts
from kvmesh.shared.transport.rdma_windows import WindowTable, no_windows_reply
from kvmesh.shared.transport.registry import Registry

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!I")
MAX_REQUEST_FRAME = 1 << 16  # what a peer may send us unasked
MAX_REPLY_FRAME = 1 << 22  # a window's resolution: ~40 bytes per span
_FLUSH_GRACE_S = 0.05  # time for the poller to drain a retired QP's flush completions


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int = MAX_REQUEST_FRAME
) -> dict[str, Any]:
    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if size > max_bytes:
        raise ProtocolError(f"rdma side-channel frame of {size} bytes exceeds {max_bytes}")
    try:
        message = json.loads(await reader.readexactly(size))
    except ValueError as exc:
        raise ProtocolError(f"rdma handshake frame is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"rdma handshake frame must be an object, got {message!r}")
    return message


async def write_frame(writer: asyncio.StreamWriter, message: Mapping[str, Any]) -> None:
    body = json.dumps(message).encode()
    writer.write(_FRAME.pack(len(body)) + body)
    await writer.drain()


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a side-channel proof covers: sorted keys, no spaces."""
    return json.dumps(message, sort_keys=True, separators=(",", ":")).encode()


async def dial(
    qps: QPTable, entry: QPEntry, peer_id: str, remote_peer: str, info: RdmaBackend, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The writer's side: swap QP info with the peer ``remote_peer`` at ``info``'s handshake
    address and bring ``entry``'s QP to RTS. On any failure the QP is destroyed and the error is
    a PeerUnreachableError that says what failed."""
    verbs = qps.verbs
    writer = None
    try:
        secret = lane_auth.parse_secret(info.secret)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(info.host, info.handshake_port), timeout
        )
        challenge = await asyncio.wait_for(read_frame(reader), timeout)
        nonce = bytes.fromhex(str(challenge.get("challenge", "")))
        hello = {"peer_id": peer_id, "qp": entry.info.to_dict()}
        proof = lane_auth.side_channel_proof(secret, nonce, canonical(hello))
        await write_frame(writer, {**hello, "proof": proof})
        reply = await asyncio.wait_for(read_frame(reader), timeout)
        if "error" in reply:
            raise PeerUnreachableError(
                f"peer {remote_peer} refused the rdma connection: {reply['error']}"
            )
        remote = QPInfo.from_dict(reply.get("qp", {}))
        qp_to_rtr(verbs, entry.qp, entry.info, remote, qps.limits)
        qp_to_rts(verbs, entry.qp, entry.info, qps.limits)
    except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, ProtocolError) as exc:
        _abort(qps, entry, writer)
        raise PeerUnreachableError(
            f"rdma handshake with peer {remote_peer} at {info.host}:{info.handshake_port} "
            f"failed: {exc!r} (a hang-up after the hello: the descriptor's secret is stale)"
        ) from exc
    except verbs.PyverbsError as exc:
        _abort(qps, entry, writer)
        raise PeerUnreachableError(
            f"cannot bring the queue pair to {remote_peer} to RTS: {exc}; both peers must share "
            f"a fabric (local {qps.device.name} gid {qps.gid}, remote {info.device} gid "
            f"{info.gid}); set TransportConfig.rdma_gid_index if needed"
        ) from exc
    except BaseException:
        _abort(qps, entry, writer)
        raise
    return reader, writer


def _abort(qps: QPTable, entry: QPEntry, writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        writer.close()
    qps.retire(entry)
    qps.destroy(entry)


@dataclass(eq=False)
class SideChannelServer:
    """The receiver's side: accepts hellos, brings a QP per connection to RTS, answers window
    resolutions on it, and retires the QP when the connection ends (an async context manager).
    ``windows`` is None where the NIC binds no memory windows."""

    qps: QPTable
    windows: WindowTable | None
    registry: Registry
    config: TransportConfig
    peer_id: str  # ours, sent in the reply to each hello
    secret: bytes  # what a hello must prove it knows (it travels in our descriptor only)
    port: int = field(default=0, init=False)
    num_refused: int = field(default=0, init=False)  # hellos without a valid proof
    _server: asyncio.AbstractServer | None = field(default=None, init=False)
    _conns: set[asyncio.StreamWriter] = field(default_factory=set, init=False)
    _handlers: set[asyncio.Task[Any]] = field(default_factory=set, init=False)

    async def __aenter__(self) -> SideChannelServer:
        self._server = await asyncio.start_server(self._serve, self.config.tcp_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop accepting, hang up every connection and wait until their QPs are retired."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._conns):
            writer.close()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        entry = await self._accept(reader, writer)
        if entry is None:
            return
        try:
            while True:  # until the peer closes its endpoint (or dies)
                request = await read_frame(reader)
                reply, keep = self._answer(entry, request)
                await write_frame(writer, reply)
                if not keep:
                    break
        except ProtocolError as exc:
            self.registry.count_refused(entry.peer_id, f"rdma side channel: {exc}")
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            await self._end(writer, entry)

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> QPEntry | None:
        """The hello: our QP for this connection, at RTS; None if the handshake failed."""
        verbs, entry = self.qps.verbs, None
        try:
            nonce = secrets.token_bytes(lane_auth.NONCE_BYTES)
            await write_frame(writer, {"challenge": nonce.hex()})
            timeout = self.config.handshake_timeout_s
            request = await asyncio.wait_for(read_frame(reader), timeout)
            proof = request.pop("proof", None)
            if not lane_auth.proof_matches(self.secret, nonce, canonical(request), proof):
                self.num_refused += 1
                self.registry.count_refused(str(request.get("peer_id", "?")), "rdma hello")
                await self._end(writer, None)  # no QP, nothing said
                return None
            remote = QPInfo.from_dict(request.get("qp", {}))
            entry = self.qps.new(str(request.get("peer_id", "?")), accepting=True)
            entry.conn = writer
            qp_to_rtr(verbs, entry.qp, entry.info, remote, self.qps.limits)
            qp_to_rts(verbs, entry.qp, entry.info, self.qps.limits)
            await write_frame(writer, {"peer_id": self.peer_id, "qp": entry.info.to_dict()})
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError):
            await self._end(writer, entry)  # the peer went away mid-handshake, or sent garbage
            return None
        except (TransportError, verbs.PyverbsError) as exc:
            log.warning("rdma handshake refused: %s", exc)
            with contextlib.suppress(OSError):
                await write_frame(writer, {"error": str(exc)})
            await self._end(writer, entry)
            return None
        return entry

    def _answer(self, entry: QPEntry, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The reply to a side-channel request, and whether the connection goes on."""
        if self.windows is None:
            return no_windows_reply(request)
        if entry.closed:
            return {"error": "the connection is in the error state", "reason": 0}, False
        return self.windows.answer(request, entry.qp, entry.peer_id)

    async def _end(self, writer: asyncio.StreamWriter, entry: QPEntry | None) -> None:
        self._conns.discard(writer)
        writer.close()
        if entry is not None:
            if self.windows is not None:
                self.windows.drop_connection(entry.info.qpn)
            self.qps.retire(entry)
            await asyncio.sleep(_FLUSH_GRACE_S)
            self.qps.destroy(entry)
