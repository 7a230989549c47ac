"""Work completions of the rdma backend: one thread polls the transport's CQ.

A send-side completion settles the write or read segment it ends (its future, on the event
loop); a receive-side one is an immediate, which becomes one ``Completion`` for the receiver, and
its receive WR is posted again. A receive that fails on a QP we did not retire means the NIC
refused a peer's access and moved the QP to the error state: counted as a refused access, and
the connection is closed.

The CQ is polled with a backoff sleep: pyverbs' ``CompChannel.get_cq_event`` blocks while holding
the GIL and exposes no fd for ``loop.add_reader``, so waiting on a completion channel would stall
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.errors import TransportError
from kvmesh.shared.transport.rdma_connections import QPEntry, QPTable
from kvmesh.shared.transport.rdma_qp import RECV_WR_ID_BIT, completion_error, status_name
from kvmesh.shared.transport.rdma_windows import WindowTable
from kvmesh.shared.transport.registry import Registry

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma_endpoint import RdmaEndpoint

log = logging.getLogger(__name__)

_POLL_BATCH = 64
_BUSY_SLEEP_S = 20e-6  # while operations are in flight
_IDLE_SLEEP_S = 1e-3  # longest backoff with nothing in flight


@dataclass(slots=True)
class _Pending:
    fut: asyncio.Future[None]
    endpoint: RdmaEndpoint
    num_wrs: int


class CompletionPoller:
    """The CQ's poller thread and the segments in flight (send-side WR ids -> futures)."""

    def __init__(
        self,
        verbs: Any,
        cq: Any,
        qps: QPTable,
        windows: WindowTable | None,
        registry: Registry,
        queue: CompletionQueue,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.verbs = verbs
        self.cq = cq
        self.qps = qps
        self.windows = windows  # None: the NIC binds no memory windows
        self.registry = registry
        self.queue = queue
        self.loop = loop
        self._pending: dict[int, _Pending] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll_loop, name="rdma-cq", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread (the segments still in flight stay pending: ``fail_all`` them)."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- segments in flight (event loop) -----------------------------------------------------------

    def track(self, wr_id: int, endpoint: RdmaEndpoint, num_wrs: int) -> asyncio.Future[None]:
        """A future resolved when segment ``wr_id`` (``num_wrs`` WRs) completes."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[wr_id] = _Pending(fut, endpoint, num_wrs)
        return fut

    def complete(self, wr_id: int, error: TransportError | None) -> None:
        """Settle segment ``wr_id``; later completions of it (flushes) are ignored."""
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

    def fail_all(self, error: TransportError) -> None:
        for wr_id in list(self._pending):
            self.complete(wr_id, error)

    # -- the poller thread -------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        idle = 0
        while not self._stop.is_set():
            try:
                n, wcs = self.cq.poll(_POLL_BATCH)
            except self.verbs.PyverbsError as exc:
                log.error("polling the rdma CQ failed; failing everything in flight: %s", exc)
                self._call_soon(self.fail_all, TransportError(f"polling the CQ failed: {exc}"))
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
        entry = self.qps.get(wc.qp_num)
        if entry is None:
            return
        if wc.status != e.IBV_WC_SUCCESS:
            self._on_receive_error(entry, wc.status)
            return
        self.qps.repost_recv(entry)
        if wc.opcode != e.IBV_WC_RECV_RDMA_WITH_IMM:
            log.warning(
                "peer %s sent opcode %s, not a write with imm; ignored", entry.peer_id, wc.opcode
            )
            return
        if wc.byte_len == 0:  # the NIC checks no key for a zero-length write (IBTA C9-88)
            self.registry.count_refused(
                entry.peer_id, "an immediate without data (checked against no key); refused"
            )
            return
        # byte_len counts the bytes of the WR that carried the imm (the batch's last one)
        self.registry.count_write(wc.byte_len)
        imm = socket.ntohl(wc.imm_data)
        # The immediate arrives without the key its write used: what vouches for its writer is
        # the connection, that is the windows it resolved (the peer id is only declared).
        keys = self.windows.keys_bound_on(wc.qp_num) if self.windows is not None else None
        self.queue.put(Completion(imm, entry.peer_id, wc.byte_len, keys))

    def _on_receive_error(self, entry: QPEntry, status: int) -> None:
        """A receive completed in error on a QP we did not retire: the NIC moved it to the error
        state because the peer broke a rule (responder class C errors: an rkey that names no
        live window or region, a span outside it, missing access; an invalid request). Counted
        once as a refused access; the connection is closed."""
        if not self.qps.mark_failed(entry):
            return  # retired by us: flushes are how it drains
        reason = (
            "the NIC refused an access and moved the connection to the error state (receive "
            f"{status_name(self.verbs, status)}): a key that names no live window, a span "
            "outside it, or a region's own key; the connection is closed"
        )
        self.registry.count_refused(entry.peer_id, reason)
        self._call_soon(_hang_up, entry)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self.loop.call_soon_threadsafe(fn, *args)


def _hang_up(entry: QPEntry) -> None:
    if entry.conn is not None:
        entry.conn.close()
