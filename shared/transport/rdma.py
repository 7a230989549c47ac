"""RDMA backend (pyverbs): RC queue pairs, RDMA WRITE WITH IMM, hardware rkeys.

One transport holds a device context, a PD, one CQ shared by all its QPs, a poller thread and a
TCP side channel. RC QPs are per connection pair, so ``connect(descriptor)`` creates a QP, swaps
QP info (qpn, psn, gid, lid, mtu) with the peer over the side channel (address in the descriptor)
and both sides go INIT -> RTR -> RTS. The side-channel socket stays open for the connection's
life; when it closes the peer's QP is torn down.

Writes (rdma_endpoint.py): a batch of WriteEntry becomes RDMA_WRITE work requests chained with
next_wr, the last one RDMA_WRITE_WITH_IMM and signaled; its completion arrives after the responder
acknowledged every byte, so ``write()`` returning means "placed". Each incoming imm consumes a
receive WR, which the poller reposts, and becomes one Completion. Reads are RDMA_READ chains.

The CQ is polled from a thread with a backoff sleep: pyverbs' ``CompChannel.get_cq_event`` blocks
while holding the GIL and exposes no fd for ``loop.add_reader``, so waiting on a completion channel
would stall the event loop.

Lease-scoped writes (rdma_windows.py): where the NIC offers memory windows, ``open_window`` gives
a random key that a writer resolves over the side channel into MWs bound, on its own connection,
to exactly the window's spans; ``close_window`` deallocates them. A refusal by the NIC moves the
receiving QP to the error state: the poller counts it as a refused access and hangs up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvmesh.shared.transport.base import (
    Access,
    Buffer,
    MemoryRegion,
    MemoryWindow,
    PeerDescriptor,
    TransportStats,
    local_host_id,
    new_peer_id,
    unenforced_window,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    BackendUnavailableError,
    PeerUnreachableError,
    ProtocolError,
    TransportClosedError,
    TransportError,
)
from kvmesh.shared.transport.rdma_device import (
    RdmaPeerInfo,
    choose_device,
    choose_gid,
    cuda_dmabuf_export,
    rdma_available,
    require_pyverbs,
)
from kvmesh.shared.transport.rdma_endpoint import RdmaEndpoint
from kvmesh.shared.transport.rdma_memory import RdmaMemory
from kvmesh.shared.transport.rdma_qp import (
    RECV_WR_ID_BIT,
    QPInfo,
    QPLimits,
    clamp_limits,
    completion_error,
    create_rc_qp,
    post_recv,
    post_recvs,
    qp_to_error,
    qp_to_init,
    qp_to_rtr,
    qp_to_rts,
    read_frame,
    status_name,
    write_frame,
)
from kvmesh.shared.transport.rdma_windows import (
    NO_WINDOWS,
    WindowTable,
    choose_window_type,
    log_window_support,
    no_windows_reply,
)
from kvmesh.shared.transport.registry import Registry

__all__ = ["RdmaEndpoint", "RdmaPeerInfo", "RdmaTransport", "rdma_available"]

log = logging.getLogger(__name__)

_POLL_BATCH = 64
_BUSY_SLEEP_S = 20e-6  # while operations are in flight
_IDLE_SLEEP_S = 1e-3  # longest backoff with nothing in flight
_FLUSH_GRACE_S = 0.05  # time for the poller to drain a retired QP's flush completions


@dataclass(slots=True)
class QPEntry:
    qp: Any
    info: QPInfo
    peer_id: str
    closed: bool = False
    conn: asyncio.StreamWriter | None = None  # an accepted QP's side channel


@dataclass(slots=True)
class _Pending:
    fut: asyncio.Future[None]
    endpoint: RdmaEndpoint
    num_wrs: int


class RdmaTransport:
    """The rdma backend; use as ``async with RdmaTransport(config) as t``.

    ``verbs``: the pyverbs namespace (``rdma_device.load_pyverbs()``); tests inject a stand-in.
    ``config.extra`` knobs: ``rdma_port`` (device port), ``rdma_send_depth``, ``rdma_recv_depth``
    (work requests per QP), ``rdma_cq_depth``, ``rdma_memory_windows`` (False: never bind memory
    windows, even where the NIC offers them; writes are then scoped to the region only).
    """

    name = "rdma"

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        registry: Registry | None = None,
        completions: CompletionQueue | None = None,
        verbs: Any = None,
        dmabuf_exporter: Callable[[int, int], tuple[int, int]] = cuda_dmabuf_export,
    ) -> None:
        self.config = config or TransportConfig()
        self.verbs = verbs if verbs is not None else require_pyverbs()
        self._peer_id = self.config.peer_id or new_peer_id()
        self._registry = registry if registry is not None else Registry()
        self._queue = completions if completions is not None else CompletionQueue()
        self._dmabuf_exporter = dmabuf_exporter
        extra = self.config.extra
        defaults = QPLimits()
        self._want_limits = dataclasses.replace(
            defaults,
            send_depth=int(extra.get("rdma_send_depth", defaults.send_depth)),
            recv_depth=int(extra.get("rdma_recv_depth", defaults.recv_depth)),
        )
        self._cq_depth = int(extra.get("rdma_cq_depth", 16384))
        self._qps: dict[int, QPEntry] = {}
        self._qp_lock = threading.Lock()  # QP teardown vs receive-WR reposts from the poller
        self._pending: dict[int, _Pending] = {}
        self._wr_ids = iter(range(1, RECV_WR_ID_BIT))
        self._endpoints: set[RdmaEndpoint] = set()
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx = self._pd = self._cq = self._ctrl_cq = self._recv_mr = None
        self.memory: RdmaMemory | None = None
        self.windows: WindowTable | None = None
        self.memory_windows = NO_WINDOWS  # the MW type bound per lease, once started
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def completion_queue(self) -> CompletionQueue:
        return self._queue

    async def __aenter__(self) -> RdmaTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the device, PD, CQ; listen for handshakes; start polling."""
        if self._ctx is not None:
            return
        v = self.verbs
        self._loop = asyncio.get_running_loop()
        self._ctx, self.device = choose_device(v, self.config.rdma_device)
        try:
            port = int(self.config.extra.get("rdma_port", self.device.port))
            if port != self.device.port:
                attr = self._ctx.query_port(port)
                self.device = dataclasses.replace(self.device, port=port, port_attr=attr)
            self.gid_index, self.gid = choose_gid(
                v, self._ctx, self.device, self.config.rdma_gid_index
            )
            dev_attr = self._ctx.query_device()
            self.limits = clamp_limits(self._want_limits, dev_attr, self.device.port_attr)
            self._pd = v.PD(self._ctx)
            self._cq = v.CQ(self._ctx, min(self._cq_depth, dev_attr.max_cqe), None, None, 0)
            # receive WRs need an lkey even though write-with-imm puts no payload there
            self._recv_mr = v.MR(self._pd, 64, v.e.IBV_ACCESS_LOCAL_WRITE)
            if self.config.extra.get("rdma_memory_windows", True):
                self.memory_windows = choose_window_type(v, dev_attr)
            if self.memory_windows != NO_WINDOWS:  # accepted QPs' send CQ: binds only
                self._ctrl_cq = v.CQ(self._ctx, self.limits.send_depth + 16, None, None, 0)
        except (v.PyverbsError, BackendUnavailableError) as exc:
            self._close_verbs()
            raise BackendUnavailableError(
                f"cannot set up RDMA device {self.device.name}: {exc}"
            ) from exc
        self.memory = RdmaMemory(
            v,
            self._pd,
            self._registry,
            self._dmabuf_exporter,
            mw_bind=self.memory_windows != NO_WINDOWS,
        )
        log_window_support(self.device.name, self.memory_windows)
        if self.memory_windows != NO_WINDOWS:
            self.windows = WindowTable(
                v,
                self._pd,
                self.memory_windows,
                self._ctrl_cq,
                self._registry,
                self.next_wr_id,
                self.limits.send_depth // 2,
            )
        self._server = await asyncio.start_server(self._serve, self.config.tcp_host, 0)
        self.handshake_port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._poll_loop, name="rdma-cq", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for ep in list(self._endpoints):
            await ep.aclose()
        for writer in list(self._conns):
            writer.close()
        if self._handlers:  # accepted connections retire their QPs as their sockets close
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self.windows is not None:  # MWs go before the QPs they are bound on and their MRs
            self.windows.close_all()
        for entry in list(self._qps.values()):
            self.retire_qp(entry)
            self.destroy_qp(entry)
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(TransportClosedError("rdma transport closed"))
        if self.memory is not None:
            self.memory.close()
        self._close_verbs()

    def _close_verbs(self) -> None:
        for obj in (self._recv_mr, self._ctrl_cq, self._cq, self._pd, self._ctx):
            if obj is not None:
                with contextlib.suppress(self.verbs.PyverbsError):
                    obj.close()
        self._recv_mr = self._ctrl_cq = self._cq = self._pd = self._ctx = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("rdma transport is closed")
        if self._ctx is None:
            raise TransportError("enter the rdma transport (async with) before using it")

    # -- memory ------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Page-aligned host memory for a receiving KVPool; freed when the transport closes."""
        self._check_open()
        return self.memory.allocate(nbytes)

    def register(self, memory: Buffer, access: Access = Access.LOCAL) -> MemoryRegion:
        """Register host memory (MR) or a CUDA tensor (dma-buf MR); the MR's rkey is the rkey."""
        self._check_open()
        return self.memory.register(memory, access)

    def deregister(self, region: MemoryRegion) -> None:
        self._check_open()
        if self.windows is not None:  # an MR with bound MWs cannot be deregistered
            self.windows.close_region(region)
        self.memory.deregister(region)

    def open_window(
        self,
        region: MemoryRegion,
        spans: Sequence[tuple[int, int]],
        access: Access = Access.REMOTE_WRITE,
    ) -> MemoryWindow:
        """A random key to ``spans`` of ``region`` alone: a writer resolves it into memory
        windows bound on its connection (rdma_windows.py). Where the NIC binds no memory windows
        the window is the region itself (``enforced`` False): the NIC checks its bounds only."""
        self._check_open()
        if self.windows is None:
            return unenforced_window(region, spans, access)
        return self.windows.open(self.memory.registration(region), spans, access)

    def close_window(self, window: MemoryWindow) -> None:
        """Invalidate the window's memory windows; later accesses with its key fail on the NIC.
        Closing twice, or an unenforced window, is a no-op."""
        if self.windows is not None and window.enforced:
            self.windows.close(window)

    # -- descriptor and connections ----------------------------------------------------------------

    def peer_info(self) -> RdmaPeerInfo:
        self._check_open()
        return RdmaPeerInfo(
            device=self.device.name,
            port=self.device.port,
            lid=self.device.port_attr.lid,
            gid=self.gid,
            gid_index=self.gid_index,
            mtu=self.device.port_attr.active_mtu,
            host=self.config.tcp_advertise_host or self.config.tcp_host,
            handshake_port=self.handshake_port,
            iova=self.memory.iova_map(),
            memory_windows=self.memory_windows,
        )

    def descriptor(self) -> PeerDescriptor:
        return PeerDescriptor(
            peer_id=self._peer_id,
            host_id=local_host_id(),
            backends={"rdma": self.peer_info().to_dict()},
            regions=self.memory.remote_regions(),
        )

    async def connect(self, descriptor: PeerDescriptor) -> RdmaEndpoint:
        """Create an RC QP, swap QP info over the peer's side channel, bring the QP to RTS."""
        self._check_open()
        part = descriptor.backends.get("rdma")
        if part is None:
            raise PeerUnreachableError(
                f"peer {descriptor.peer_id} offers no rdma backend (it offers "
                f"{sorted(descriptor.backends)})"
            )
        info = RdmaPeerInfo.from_dict(part)
        entry = self._new_qp(descriptor.peer_id, accepting=False)
        timeout = self.config.connect_timeout_s
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(info.host, info.handshake_port), timeout
            )
            await write_frame(writer, {"peer_id": self._peer_id, "qp": entry.info.to_dict()})
            reply = await asyncio.wait_for(read_frame(reader), timeout)
            if "error" in reply:
                raise PeerUnreachableError(
                    f"peer {descriptor.peer_id} refused the rdma connection: {reply['error']}"
                )
            remote = QPInfo.from_dict(reply.get("qp", {}))
            qp_to_rtr(self.verbs, entry.qp, entry.info, remote, self.limits)
            qp_to_rts(self.verbs, entry.qp, entry.info, self.limits)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
            self._abort(entry, writer)
            raise PeerUnreachableError(
                f"rdma handshake with peer {descriptor.peer_id} at {info.host}:"
                f"{info.handshake_port} failed: {exc!r}"
            ) from exc
        except self.verbs.PyverbsError as exc:
            self._abort(entry, writer)
            raise PeerUnreachableError(
                f"cannot bring the queue pair to {descriptor.peer_id} to RTS: {exc}; both peers "
                f"must share a fabric (local {self.device.name} gid {self.gid}, remote "
                f"{info.device} gid {info.gid}); set TransportConfig.rdma_gid_index if needed"
            ) from exc
        except BaseException:
            self._abort(entry, writer)
            raise
        ep = RdmaEndpoint(
            self,
            entry,
            descriptor.peer_id,
            descriptor.regions,
            dict(info.iova),
            writer,
            reader,
            info.memory_windows,
        )
        self._endpoints.add(ep)
        return ep

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Accept side of the handshake; then answers window resolutions on the socket and holds
        the connection's QP until the socket closes."""
        self._conns.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        entry = None
        try:
            request = await asyncio.wait_for(read_frame(reader), self.config.connect_timeout_s)
            remote = QPInfo.from_dict(request.get("qp", {}))
            entry = self._new_qp(str(request.get("peer_id", "?")), accepting=True)
            entry.conn = writer
            qp_to_rtr(self.verbs, entry.qp, entry.info, remote, self.limits)
            qp_to_rts(self.verbs, entry.qp, entry.info, self.limits)
            await write_frame(writer, {"peer_id": self._peer_id, "qp": entry.info.to_dict()})
        except (TransportError, self.verbs.PyverbsError) as exc:
            log.warning("rdma handshake refused: %s", exc)
            with contextlib.suppress(OSError):
                await write_frame(writer, {"error": str(exc)})
            await self._end_connection(writer, entry)
            return
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            await self._end_connection(writer, entry)  # the peer went away mid-handshake
            return
        try:
            while True:  # until the peer closes its endpoint (or dies)
                request = await read_frame(reader)
                reply, keep = self._answer(entry, request)
                await write_frame(writer, reply)
                if not keep:
                    break
        except ProtocolError as exc:
            self._registry.count_refused(entry.peer_id, f"rdma side channel: {exc}")
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            await self._end_connection(writer, entry)

    async def _end_connection(self, writer: asyncio.StreamWriter, entry: QPEntry | None) -> None:
        self._conns.discard(writer)
        writer.close()
        if entry is not None:
            if self.windows is not None:
                self.windows.drop_connection(entry.info.qpn)
            self.retire_qp(entry)
            await asyncio.sleep(_FLUSH_GRACE_S)
            self.destroy_qp(entry)

    def _answer(self, entry: QPEntry, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The reply to a side-channel request, and whether the connection goes on."""
        if self.windows is None:
            return no_windows_reply(request)
        if entry.closed:
            return {"error": "the connection is in the error state", "reason": 0}, False
        return self.windows.answer(request, entry.qp, entry.peer_id)

    def _new_qp(self, peer_id: str, *, accepting: bool) -> QPEntry:
        v = self.verbs
        max_qps = self._cq.cqe // (self.limits.send_depth + self.limits.recv_depth)
        if len(self._qps) >= max_qps:
            raise TransportError(
                f"{len(self._qps)} rdma connections fill the completion queue; raise "
                "TransportConfig.extra['rdma_cq_depth'] or lower rdma_send_depth/rdma_recv_depth"
            )
        send_cq = self._ctrl_cq if accepting else None
        qp = create_rc_qp(v, self._pd, self._cq, self.limits, send_cq=send_cq)
        try:
            qp_to_init(v, qp, self.device.port)
            if accepting:  # receive WRs must be posted before RTR: imms may arrive right away
                post_recvs(v, qp, self.limits.recv_depth, self._recv_mr.buf, self._recv_mr.lkey)
        except v.PyverbsError:
            qp.close()
            raise
        info = QPInfo(
            qpn=qp.qp_num,
            psn=secrets.randbits(24),
            gid=self.gid,
            gid_index=self.gid_index,
            lid=self.device.port_attr.lid,
            port=self.device.port,
            mtu=self.device.port_attr.active_mtu,
        )
        entry = QPEntry(qp, info, peer_id)
        self._qps[info.qpn] = entry
        return entry

    def _abort(self, entry: QPEntry, writer: asyncio.StreamWriter | None) -> None:
        if writer is not None:
            writer.close()
        self.retire_qp(entry)
        self.destroy_qp(entry)

    def retire_qp(self, entry: QPEntry) -> None:
        """Move the QP to ERR so every posted WR flushes; idempotent."""
        with self._qp_lock:
            if entry.closed:
                return
            entry.closed = True
            with contextlib.suppress(self.verbs.PyverbsError):
                qp_to_error(self.verbs, entry.qp)

    def destroy_qp(self, entry: QPEntry) -> None:
        with self._qp_lock:
            self._qps.pop(entry.info.qpn, None)
            with contextlib.suppress(self.verbs.PyverbsError):
                entry.qp.close()

    def forget_endpoint(self, endpoint: RdmaEndpoint) -> None:
        self._endpoints.discard(endpoint)

    def completions(self) -> AsyncIterator[Completion]:
        return aiter(self._queue)

    def stats(self) -> TransportStats:
        return self._registry.stats()

    # -- work completions --------------------------------------------------------------------------

    def next_wr_id(self) -> int:
        return next(self._wr_ids)

    def track(self, wr_id: int, endpoint: RdmaEndpoint, num_wrs: int) -> asyncio.Future[None]:
        """A future resolved when segment ``wr_id`` (``num_wrs`` WRs) completes."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[wr_id] = _Pending(fut, endpoint, num_wrs)
        return fut

    def complete(self, wr_id: int, error: TransportError | None) -> None:
        """Event loop: settle segment ``wr_id``; later completions of it (flushes) are ignored."""
        pending = self._pending.pop(wr_id, None)
        if pending is None:
            return
        pending.endpoint.on_segment_done(pending.num_wrs, error)
        if pending.fut.done():
            return
        if error is None:
            pending.fut.set_result(None)
        else:
            pending.fut.set_exception(error)

    def has_pending(self, endpoint: RdmaEndpoint) -> bool:
        return any(p.endpoint is endpoint for p in list(self._pending.values()))

    def fail_pending(self, endpoint: RdmaEndpoint, error: TransportError) -> None:
        for wr_id, p in list(self._pending.items()):
            if p.endpoint is endpoint:
                self.complete(wr_id, error)

    def _poll_loop(self) -> None:
        idle = 0
        while not self._stop.is_set():
            try:
                n, wcs = self._cq.poll(_POLL_BATCH)
            except self.verbs.PyverbsError as exc:
                log.error("polling the rdma CQ failed; failing everything in flight: %s", exc)
                self._call_soon(self._fail_all, TransportError(f"polling the CQ failed: {exc}"))
                return
            if n:
                idle = 0
                for wc in wcs:
                    self.on_work_completion(wc)
                continue
            idle = min(idle + 1, 10)
            time.sleep(_BUSY_SLEEP_S if self._pending else min(_IDLE_SLEEP_S, 1e-5 * 2**idle))

    def on_work_completion(self, wc: Any) -> None:
        """Poller thread: route one work completion (receive -> Completion, send -> future)."""
        e = self.verbs.e
        if not wc.wr_id & RECV_WR_ID_BIT:
            error = None
            if wc.status != e.IBV_WC_SUCCESS:
                pending = self._pending.get(wc.wr_id)
                peer = pending.endpoint.peer_id if pending else "?"
                error = completion_error(self.verbs, wc.status, wc.vendor_err, f"rdma op to {peer}")
            self._call_soon(self.complete, wc.wr_id, error)
            return
        entry = self._qps.get(wc.qp_num)
        if entry is None:
            return
        if wc.status != e.IBV_WC_SUCCESS:
            self._on_receive_error(entry, wc.status)
            return
        with self._qp_lock:
            if not entry.closed:
                post_recv(self.verbs, entry.qp, self._recv_mr.buf, self._recv_mr.lkey)
        if wc.opcode != e.IBV_WC_RECV_RDMA_WITH_IMM:
            log.warning(
                "peer %s sent opcode %s, not a write with imm; ignored", entry.peer_id, wc.opcode
            )
            return
        if wc.byte_len == 0:  # the NIC checks no key for a zero-length write (IBTA C9-88)
            self._registry.count_refused(
                entry.peer_id, "an immediate without data (checked against no key); refused"
            )
            return
        # byte_len counts the bytes of the WR that carried the imm (the batch's last one)
        self._registry.count_write(wc.byte_len)
        imm = socket.ntohl(wc.imm_data)
        self._queue.put(Completion(imm=imm, peer_id=entry.peer_id, num_bytes=wc.byte_len))

    def _on_receive_error(self, entry: QPEntry, status: int) -> None:
        """A receive completed in error on a QP we did not retire: the NIC moved it to the error
        state because the peer broke a rule (responder class C errors: an rkey that names no
        live window or region, a span outside it, missing access; an invalid request). Counted
        once as a refused access; the connection is closed."""
        with self._qp_lock:
            if entry.closed:
                return  # retired by us: flushes are how it drains
            entry.closed = True
        reason = (
            "the NIC refused an access and moved the connection to the error state (receive "
            f"{status_name(self.verbs, status)}): a key that names no live window, a span "
            "outside it, or a region's own key; the connection is closed"
        )
        self._registry.count_refused(entry.peer_id, reason)
        self._call_soon(self._hang_up, entry)

    def _hang_up(self, entry: QPEntry) -> None:
        if entry.conn is not None:
            entry.conn.close()

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, *args)

    def _fail_all(self, error: TransportError) -> None:
        for wr_id in list(self._pending):
            self.complete(wr_id, error)
