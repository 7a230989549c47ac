"""A recording stand-in for pyverbs: the names shared/transport/rdma*.py use, over a simulated
loopback fabric.

``FakeVerbs()`` is injected as ``RdmaTransport(verbs=...)``. Every verb call is appended to
``fabric.log`` (as plain tuples/dicts) for assertions. Like a NIC, the fabric checks what real
hardware checks (QP state transition masks, PSNs, lkeys/rkeys/bounds/access of each SGE, receive WRs
for immediates) and moves bytes with ``ctypes.memmove`` between process addresses, so two
transports in one process can exchange real writes. Enum values are rdma-core's.

Memory windows follow rdma_rxe and libibverbs: MR and MW keys share one index space (``index << 8
| 8-bit tag``); type 1 is bound with ``QP.bind_mw`` (libibverbs refuses other types there) and
is usable from every QP of its PD; type 2 is bound with an ``IBV_WR_BIND_MW`` work request, must
be free, is usable only through the QP it was bound on, and libibverbs leaves its ``rkey`` as
allocated (so a second bind of the same MW carries a stale key and fails, as on rxe);
``IBV_WR_LOCAL_INV`` frees a type-2 MW; deallocation invalidates any MW. A remote access with a
bad key, outside the MR/MW bounds or without the access fails with REM_ACCESS_ERR at the requester
and moves the responder QP to the error state (IBTA class C: its receive WRs flush). A zero-length
write is checked against no key (IBTA C9-88).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class e:  # mirrors pyverbs.enums
    IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
    IBV_QP_STATE, IBV_QP_CUR_STATE, IBV_QP_ACCESS_FLAGS = 1, 2, 8
    IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_AV, IBV_QP_PATH_MTU = 16, 32, 128, 256
    IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN = 512, 1024, 2048, 4096
    IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN = 8192, 32768, 65536
    IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_DEST_QPN = 131072, 1048576
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_RDMA_READ = 0, 1, 2, 4
    IBV_WR_LOCAL_INV, IBV_WR_BIND_MW = 7, 8
    IBV_SEND_SIGNALED = 2
    IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_PROT_ERR, IBV_WC_WR_FLUSH_ERR = 0, 1, 4, 5
    IBV_WC_LOC_QP_OP_ERR, IBV_WC_MW_BIND_ERR = 2, 6
    IBV_WC_LOC_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR = 8, 9, 10
    IBV_WC_REM_OP_ERR, IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR = 11, 12, 13
    IBV_WC_REM_ABORT_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_GENERAL_ERR = 16, 20, 21
    IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM = 1, 2, 128, 129
    IBV_WC_BIND_MW, IBV_WC_LOCAL_INV = 5, 6
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
    IBV_ACCESS_MW_BIND = 16
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20
    IBV_MW_TYPE_1, IBV_MW_TYPE_2 = 1, 2
    IBV_DEVICE_MEM_WINDOW = 1 << 17
    IBV_DEVICE_MEM_WINDOW_TYPE_2A, IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 23, 1 << 24
    IBV_QPT_RC = 2
    IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 = 1, 2, 3, 4, 5
    IBV_PORT_DOWN, IBV_PORT_ACTIVE = 1, 4
    IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 1, 2
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2 = 0, 1


class PyverbsError(Exception):
    pass


class PyverbsUserError(PyverbsError):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg)
        self.error_code = error_code


# -- transition rules: required attribute masks (IB spec / ibv_modify_qp) -----------------------

_REQUIRED = {
    (e.IBV_QPS_RESET, e.IBV_QPS_INIT): e.IBV_QP_STATE
    | e.IBV_QP_PKEY_INDEX
    | e.IBV_QP_PORT
    | e.IBV_QP_ACCESS_FLAGS,
    (e.IBV_QPS_INIT, e.IBV_QPS_RTR): e.IBV_QP_STATE
    | e.IBV_QP_AV
    | e.IBV_QP_PATH_MTU
    | e.IBV_QP_DEST_QPN
    | e.IBV_QP_RQ_PSN
    | e.IBV_QP_MAX_DEST_RD_ATOMIC
    | e.IBV_QP_MIN_RNR_TIMER,
    (e.IBV_QPS_RTR, e.IBV_QPS_RTS): e.IBV_QP_STATE
    | e.IBV_QP_SQ_PSN
    | e.IBV_QP_TIMEOUT
    | e.IBV_QP_RETRY_CNT
    | e.IBV_QP_RNR_RETRY
    | e.IBV_QP_MAX_QP_RD_ATOMIC,
}
_ATTR_BITS = {
    "qp_state": e.IBV_QP_STATE,
    "pkey_index": e.IBV_QP_PKEY_INDEX,
    "port_num": e.IBV_QP_PORT,
    "qp_access_flags": e.IBV_QP_ACCESS_FLAGS,
    "path_mtu": e.IBV_QP_PATH_MTU,
    "dest_qp_num": e.IBV_QP_DEST_QPN,
    "rq_psn": e.IBV_QP_RQ_PSN,
    "sq_psn": e.IBV_QP_SQ_PSN,
    "timeout": e.IBV_QP_TIMEOUT,
    "retry_cnt": e.IBV_QP_RETRY_CNT,
    "rnr_retry": e.IBV_QP_RNR_RETRY,
    "max_rd_atomic": e.IBV_QP_MAX_QP_RD_ATOMIC,
    "max_dest_rd_atomic": e.IBV_QP_MAX_DEST_RD_ATOMIC,
    "min_rnr_timer": e.IBV_QP_MIN_RNR_TIMER,
}


# -- plain structs --------------------------------------------------------------------------------


class QPCap:
    def __init__(
        self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0
    ):
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge
        self.max_inline_data = max_inline_data


class QPInitAttr:
    def __init__(
        self,
        qp_type=e.IBV_QPT_RC,
        qp_context=None,
        scq=None,
        rcq=None,
        srq=None,
        cap=None,
        sq_sig_all=1,
    ):
        self.qp_type, self.send_cq, self.recv_cq, self.srq = qp_type, scq, rcq, srq
        self.cap, self.sq_sig_all = cap or QPCap(), sq_sig_all


class QPAttr:
    def __init__(self, qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET):
        self.qp_state, self.cur_qp_state = qp_state, cur_qp_state
        for name in _ATTR_BITS:
            if name != "qp_state":
                setattr(self, name, 0)
        self.port_num = 1
        self.ah_attr = None


class GID:
    def __init__(self, val: str = "0000:0000:0000:0000:0000:0000:0000:0000") -> None:
        self.gid = val


class GlobalRoute:
    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        self.dgid = dgid.gid if isinstance(dgid, GID) else dgid
        self.sgid_index = sgid_index


class AHAttr:
    def __init__(
        self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None
    ):
        self.dlid, self.is_global, self.port_num = dlid, is_global, port_num
        self.dgid = gr.dgid if gr else None
        self.sgid_index = gr.sgid_index if gr else 0


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(
        self,
        wr_id=0,
        opcode=e.IBV_WR_SEND,
        num_sge=0,
        imm_data=0,
        sg=None,
        send_flags=e.IBV_SEND_SIGNALED,
        next_wr=None,
    ):
        if num_sge > len(sg or ()):
            raise PyverbsUserError(f"num_sge={num_sge} but {len(sg or ())} SGEs given")
        self.wr_id, self.opcode, self.num_sge, self.imm_data = wr_id, opcode, num_sge, imm_data
        self.sg = list(sg or ())[:num_sge]
        self.send_flags, self.next = send_flags, next_wr
        self.remote_addr = self.rkey = None
        self.bind_mw = self.bind_info = self.bind_mw_rkey = None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr

    def set_bind_wr(self, mw: MW, bind_info: MWBindInfo) -> None:
        """As pyverbs: the new rkey (``.rkey``) is ``ibv_inc_rkey(mw.rkey)``."""
        self.bind_mw, self.bind_info = mw, bind_info
        self.bind_mw_rkey = mw.rkey  # what the provider tells the NIC the MW's key is
        self.rkey = inc_rkey(mw.rkey)


class MWBindInfo:
    def __init__(self, mr: MR, addr: int, length: int, mw_access_flags: int) -> None:
        self.mr, self.addr, self.length = mr, addr, length
        self.mw_access_flags = mw_access_flags


class MWBind:
    def __init__(self, info: MWBindInfo, send_flags: int, wr_id: int = 0) -> None:
        self.info, self.send_flags, self.wr_id = info, send_flags, wr_id


def inc_rkey(rkey: int) -> int:
    """libibverbs' ibv_inc_rkey: the next 8-bit tag, same index."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


class RecvWR:
    def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None):
        if num_sge < 1 or sg is None:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.wr_id, self.num_sge, self.sg, self.next = wr_id, num_sge, list(sg), next_wr


@dataclass
class WC:
    wr_id: int
    status: int
    opcode: int = 0
    qp_num: int = 0
    byte_len: int = 0
    imm_data: int = 0
    vendor_err: int = 0


# -- the fabric -------------------------------------------------------------------------------------


@dataclass
class FakeDevice:
    name: str = "rxe0"
    gids: tuple[str, ...] = (
        "fe80:0000:0000:0000:0000:00ff:fe00:0001",
        "0000:0000:0000:0000:0000:ffff:0a00:0001",
    )
    port_state: int = e.IBV_PORT_ACTIVE
    active_mtu: int = e.IBV_MTU_1024
    link_layer: int = e.IBV_LINK_LAYER_ETHERNET
    lid: int = 0
    max_qp_wr: int = 16384
    max_sge: int = 32
    max_cqe: int = 65536
    max_msg_sz: int = 1 << 31
    accepts_relaxed_ordering: bool = True
    mw_types: tuple[int, ...] = (e.IBV_MW_TYPE_1, e.IBV_MW_TYPE_2)  # rxe: type 1 and 2B
    max_mw: int = 4096

    @property
    def device_cap_flags(self) -> int:
        flags = e.IBV_DEVICE_MEM_WINDOW if e.IBV_MW_TYPE_1 in self.mw_types else 0
        if e.IBV_MW_TYPE_2 in self.mw_types:
            flags |= e.IBV_DEVICE_MEM_WINDOW_TYPE_2B
        return flags


@dataclass
class Fabric:
    devices: list[FakeDevice] = field(default_factory=lambda: [FakeDevice()])
    log: list[tuple[Any, ...]] = field(default_factory=list)
    qps: dict[int, QP] = field(default_factory=dict)
    mrs: dict[int, MR] = field(default_factory=dict)  # lkey (== rkey here) -> MR
    mws: dict[int, MW] = field(default_factory=dict)  # key index -> live MW
    dmabufs: dict[int, int] = field(default_factory=dict)  # fd -> process address behind it
    keys: Any = field(default_factory=lambda: itertools.count(0x1000))  # qp numbers
    key_index: Any = field(default_factory=lambda: itertools.count(1))  # MR and MW keys

    def new_key(self) -> int:
        """``index << 8 | tag``, as rxe makes MR and MW keys (the tag varies per key)."""
        index = next(self.key_index)
        return (index << 8) | ((index * 97 + 13) & 0xFF)

    lock: threading.RLock = field(default_factory=threading.RLock)

    def events(self, kind: str) -> list[tuple[Any, ...]]:
        return [ev for ev in self.log if ev[0] == kind]


class _Obj:
    def close(self) -> None:
        self.closed = True


class Context(_Obj):
    def __init__(self, fabric: Fabric, name: str) -> None:
        found = [d for d in fabric.devices if d.name == name]
        if not found:
            raise PyverbsRDMAError(f"Failed to open device {name}", errno.ENODEV)
        self.fabric, self.dev, self.name = fabric, found[0], name

    def query_device(self) -> SimpleNamespace:
        d = self.dev
        return SimpleNamespace(
            phys_port_cnt=1,
            max_qp_wr=d.max_qp_wr,
            max_sge=d.max_sge,
            max_cqe=d.max_cqe,
            max_qp_rd_atom=16,
            max_qp_init_rd_atom=16,
            device_cap_flags=d.device_cap_flags,
            max_mw=d.max_mw,
        )

    def query_port(self, port: int) -> SimpleNamespace:
        d = self.dev
        return SimpleNamespace(
            state=d.port_state,
            lid=d.lid,
            active_mtu=d.active_mtu,
            gid_tbl_len=len(d.gids),
            link_layer=d.link_layer,
            max_msg_sz=d.max_msg_sz,
        )

    def query_gid(self, port: int, index: int) -> GID:
        return GID(self.dev.gids[index])

    def query_gid_type(self, port: int, index: int) -> int:
        return e.IBV_GID_TYPE_SYSFS_ROCE_V2


class PD(_Obj):
    def __init__(self, ctx: Context) -> None:
        self.ctx, self.fabric = ctx, ctx.fabric


class CQ(_Obj):
    def __init__(self, ctx: Context, cqe: int, cq_context=None, channel=None, comp_vector=0):
        self.ctx, self.cqe, self.channel = ctx, cqe, channel
        self._wcs: deque[WC] = deque()
        self._lock = threading.Lock()

    def push(self, wc: WC) -> None:
        with self._lock:
            self._wcs.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        with self._lock:
            out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        return len(out), out


class MR(_Obj):
    def __init__(
        self, pd: PD, length: int, access: int, address: int | None = None, implicit=False, **kw
    ):
        fabric = pd.fabric
        if access & e.IBV_ACCESS_RELAXED_ORDERING and not pd.ctx.dev.accepts_relaxed_ordering:
            raise PyverbsRDMAError("Failed to register a MR", errno.EINVAL)
        if access & e.IBV_ACCESS_MW_BIND and not pd.ctx.dev.mw_types:
            raise PyverbsRDMAError("Failed to register a MR", errno.EOPNOTSUPP)
        if address is None:
            self._own = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._own)
        self.pd, self.length, self.access, self.buf = pd, length, access, address
        self.iova = address
        self.lkey = self.rkey = fabric.new_key()
        self.mws: set[MW] = set()  # MWs bound to this MR
        fabric.mrs[self.lkey] = self
        fabric.log.append(("reg_mr", {"addr": address, "length": length, "access": access}))

    def host_addr(self, nic_addr: int) -> int:
        return nic_addr

    def close(self) -> None:
        if self.mws:  # rxe: -EINVAL while MWs are bound to it
            raise PyverbsRDMAError(f"Failed to dereg MR: {len(self.mws)} MWs bound", errno.EBUSY)
        self.pd.fabric.mrs.pop(self.lkey, None)
        self.pd.fabric.log.append(("dereg_mr", self.lkey))


class DmaBufMR(MR):
    def __init__(
        self,
        pd: PD,
        length: int,
        access: int,
        dmabuf: int | None = None,
        offset: int = 0,
        gpu=0,
        gtt=0,
    ):
        base = pd.fabric.dmabufs[dmabuf]
        super().__init__(pd, length, access, address=base + offset)
        self.iova, self.offset = offset, offset  # pyverbs registers with iova == offset
        pd.fabric.log.append(
            ("reg_dmabuf_mr", {"fd": dmabuf, "offset": offset, "length": length, "access": access})
        )

    def host_addr(self, nic_addr: int) -> int:
        return self.buf + (nic_addr - self.iova)


class MW(_Obj):
    """A memory window. ``rkey`` is what libibverbs shows (updated by ``QP.bind_mw`` only);
    ``hw_rkey`` is the NIC's current key."""

    def __init__(self, pd: PD, mw_type: int) -> None:
        fabric = pd.fabric
        dev = pd.ctx.dev
        if mw_type not in dev.mw_types:
            raise PyverbsRDMAError(f"Failed to allocate MW of type {mw_type}", errno.EOPNOTSUPP)
        if len(fabric.mws) >= dev.max_mw:
            raise PyverbsRDMAError("Failed to allocate MW", errno.ENOMEM)
        self.pd, self.fabric, self.type = pd, fabric, mw_type
        self.rkey = self.hw_rkey = fabric.new_key()
        self.mr: MR | None = None
        self.addr = self.length = self.access = 0
        self.qp: QP | None = None
        self.free = True  # type 2: may be bound; type 1: always bindable
        self.closed = False
        fabric.mws[self.rkey >> 8] = self
        fabric.log.append(("alloc_mw", mw_type, self.rkey))

    def unbind(self) -> None:
        if self.mr is not None:
            self.mr.mws.discard(self)
        self.mr, self.addr, self.length, self.access, self.qp = None, 0, 0, 0, None
        self.free = True

    def close(self) -> None:  # ibv_dealloc_mw: a bound window is invalidated with it
        if self.closed:
            return
        self.unbind()
        self.closed = True
        self.fabric.mws.pop(self.rkey >> 8, None)
        self.fabric.log.append(("dealloc_mw", self.hw_rkey))


class QP(_Obj):
    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        self.pd, self.fabric, self.init = pd, pd.fabric, init_attr
        self.cap = init_attr.cap
        self.qp_num = next(self.fabric.keys)
        self.state = e.IBV_QPS_RESET
        self.attrs: dict[str, Any] = {}
        self.recvs: deque[RecvWR] = deque()
        self.fabric.qps[self.qp_num] = self
        self.fabric.log.append(
            (
                "create_qp",
                self.qp_num,
                {
                    "max_send_wr": self.cap.max_send_wr,
                    "max_recv_wr": self.cap.max_recv_wr,
                    "max_send_sge": self.cap.max_send_sge,
                    "sq_sig_all": init_attr.sq_sig_all,
                },
            )
        )

    @property
    def qp_state(self) -> int:
        return self.state

    def modify(self, attr: QPAttr, mask: int) -> None:
        snapshot = {n: getattr(attr, n) for n, bit in _ATTR_BITS.items() if mask & bit}
        if mask & e.IBV_QP_AV:
            ah = attr.ah_attr
            snapshot["ah"] = {
                "dgid": ah.dgid,
                "sgid_index": ah.sgid_index,
                "dlid": ah.dlid,
                "is_global": ah.is_global,
                "port_num": ah.port_num,
            }
        self.fabric.log.append(("modify", self.qp_num, attr.qp_state, mask, snapshot))
        new = attr.qp_state
        if new == e.IBV_QPS_ERR:
            self._to_error()
            return
        need = _REQUIRED.get((self.state, new))
        if need is None or mask & need != need:
            raise PyverbsRDMAError(
                f"Failed to modify QP state {self.state}->{new} mask {mask:#x}", errno.EINVAL
            )
        if new == e.IBV_QPS_RTR and attr.path_mtu > self.pd.ctx.dev.active_mtu:
            raise PyverbsRDMAError("path_mtu above the port's active MTU", errno.EINVAL)
        self.attrs.update(snapshot)
        self.state = new

    def _to_error(self) -> None:
        self.fabric.log.append(("qp_error", self.qp_num))
        self.state = e.IBV_QPS_ERR
        while self.recvs:
            wr = self.recvs.popleft()
            self.init.recv_cq.push(WC(wr.wr_id, e.IBV_WC_WR_FLUSH_ERR, qp_num=self.qp_num))

    def post_recv(self, wr: RecvWR, bad_wr=None) -> None:
        self.fabric.log.append(("post_recv", self.qp_num, wr.wr_id))
        if self.state == e.IBV_QPS_RESET:
            raise PyverbsRDMAError("Failed to post recv (QP in RESET)", errno.EINVAL)
        if len(self.recvs) >= self.cap.max_recv_wr:
            raise PyverbsRDMAError("Failed to post recv (RQ full)", errno.ENOMEM)
        if self.state == e.IBV_QPS_ERR:
            self.init.recv_cq.push(WC(wr.wr_id, e.IBV_WC_WR_FLUSH_ERR, qp_num=self.qp_num))
            return
        self.recvs.append(wr)

    def post_send(self, wr: SendWR, bad_wr=None) -> None:
        chain = []
        while wr is not None:
            chain.append(wr)
            wr = wr.next
        self.fabric.log.append(("post_send", self.qp_num, [_wr_record(w) for w in chain]))
        if self.state != e.IBV_QPS_RTS:
            raise PyverbsRDMAError("Failed to post send (QP not in RTS)", errno.EINVAL)
        self._run(chain)

    def bind_mw(self, mw: MW, mw_bind: MWBind) -> None:
        """ibv_bind_mw: type 1 only (libibverbs checks), posted as a bind WR; the provider
        updates ``mw.rkey`` to the new key once posted."""
        info = mw_bind.info
        self.fabric.log.append(
            (
                "bind_mw",
                self.qp_num,
                {
                    "rkey": mw.rkey,
                    "addr": info.addr,
                    "length": info.length,
                    "access": info.mw_access_flags,
                    "send_flags": mw_bind.send_flags,
                },
            )
        )
        if mw.type != e.IBV_MW_TYPE_1:
            raise PyverbsRDMAError("Failed to Bind MW", errno.EINVAL)
        if info.mr is not None and info.mr.pd is not mw.pd:
            raise PyverbsRDMAError("Failed to Bind MW", errno.EPERM)
        if self.state != e.IBV_QPS_RTS:
            raise PyverbsRDMAError("Failed to Bind MW (QP not in RTS)", errno.EINVAL)
        wr = SendWR(wr_id=mw_bind.wr_id, opcode=e.IBV_WR_BIND_MW, send_flags=mw_bind.send_flags)
        wr.set_bind_wr(mw, info)
        mw.rkey = wr.rkey
        self._run([wr])

    def _run(self, chain: list[SendWR]) -> None:
        with self.fabric.lock:
            for w in chain:
                if len(w.sg) > self.cap.max_send_sge:
                    raise PyverbsRDMAError("Failed to post send (too many SGEs)", errno.EINVAL)
                if self.state == e.IBV_QPS_ERR:
                    status = e.IBV_WC_WR_FLUSH_ERR
                elif w.opcode == e.IBV_WR_BIND_MW:
                    status = self._bind(w)
                elif w.opcode == e.IBV_WR_LOCAL_INV:
                    status = self._invalidate(w.imm_data)  # pyverbs: imm_data is invalidate_rkey
                else:
                    status = self._execute(w)
                if status != e.IBV_WC_SUCCESS:
                    self.state = e.IBV_QPS_ERR
                if status != e.IBV_WC_SUCCESS or w.send_flags & e.IBV_SEND_SIGNALED:
                    op = _WC_OPCODE.get(w.opcode, e.IBV_WC_RDMA_WRITE)
                    self.init.send_cq.push(WC(w.wr_id, status, op, self.qp_num))
                self.fabric.log.append(("send_status", self.qp_num, w.wr_id, status))

    def _bind(self, w: SendWR) -> int:
        """rxe_bind_mw's checks; the new key's tag is the WR's, the index the MW's."""
        mw, info = w.bind_mw, w.bind_info
        if mw is None or mw.closed or w.bind_mw_rkey != mw.hw_rkey or mw.pd is not self.pd:
            return e.IBV_WC_MW_BIND_ERR
        mr = info.mr
        if mw.type == e.IBV_MW_TYPE_2 and (not mw.free or mr is None or info.length == 0):
            return e.IBV_WC_MW_BIND_ERR
        if (
            mr is not None
            and info.length
            and (
                mr.pd is not self.pd
                or not mr.access & e.IBV_ACCESS_MW_BIND
                or (
                    info.mw_access_flags & e.IBV_ACCESS_REMOTE_WRITE
                    and not mr.access & e.IBV_ACCESS_LOCAL_WRITE
                )
                or info.addr < mr.iova
                or info.addr + info.length > mr.iova + mr.length
            )
        ):
            return e.IBV_WC_MW_BIND_ERR
        mw.unbind()
        if mr is not None and info.length:
            mw.mr, mw.addr, mw.length = mr, info.addr, info.length
            mw.access, mw.free = info.mw_access_flags, False
            mw.qp = self if mw.type == e.IBV_MW_TYPE_2 else None
            mr.mws.add(mw)
        mw.hw_rkey = (mw.hw_rkey & 0xFFFFFF00) | (w.rkey & 0xFF)
        return e.IBV_WC_SUCCESS

    def _invalidate(self, rkey: int) -> int:
        mw = self.fabric.mws.get(rkey >> 8)
        if mw is None or mw.hw_rkey != rkey or mw.type != e.IBV_MW_TYPE_2 or mw.free:
            return e.IBV_WC_LOC_QP_OP_ERR
        mw.unbind()
        return e.IBV_WC_SUCCESS

    def _remote(self, peer: QP, rkey: int, addr: int, total: int, need: int) -> MR | None:
        """The MR an incoming access lands in, or None when the responder must refuse it."""
        if not peer.attrs.get("qp_access_flags", 0) & need:
            return None
        mr = self.fabric.mrs.get(rkey)
        if mr is not None:
            if mr.pd is not peer.pd or not mr.access & need:
                return None
            low, high = mr.iova, mr.iova + mr.length
        else:
            mw = self.fabric.mws.get(rkey >> 8)
            if (
                mw is None
                or mw.hw_rkey != rkey
                or mw.mr is None
                or mw.pd is not peer.pd
                or (mw.type == e.IBV_MW_TYPE_2 and mw.qp is not peer)
                or not mw.access & need
            ):
                return None
            mr, low, high = mw.mr, mw.addr, mw.addr + mw.length
        return mr if low <= addr and addr + total <= high else None

    def _execute(self, w: SendWR) -> int:
        peer = self.fabric.qps.get(self.attrs.get("dest_qp_num", -1))
        if peer is None or peer.state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS):
            return e.IBV_WC_RETRY_EXC_ERR
        if peer.attrs.get("rq_psn") != self.attrs.get("sq_psn"):
            return e.IBV_WC_RETRY_EXC_ERR  # PSN mismatch: the responder drops every packet
        total = sum(s.length for s in w.sg)
        read = w.opcode == e.IBV_WR_RDMA_READ
        need = e.IBV_ACCESS_REMOTE_READ if read else e.IBV_ACCESS_REMOTE_WRITE
        remote = None
        if total or read:  # C9-88: a zero-length write is checked against no key
            remote = self._remote(peer, w.rkey, w.remote_addr, total, need)
            if remote is None:
                peer._to_error()  # class C: the responder's QP goes to the error state
                return e.IBV_WC_REM_ACCESS_ERR
        for s in w.sg:
            local = self.fabric.mrs.get(s.lkey)
            if (
                local is None
                or local.pd is not self.pd
                or s.addr < local.iova
                or s.addr + s.length > local.iova + local.length
            ):
                return e.IBV_WC_LOC_PROT_ERR
        if w.opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM and not peer.recvs:
            return e.IBV_WC_RNR_RETRY_EXC_ERR  # the receiver never reposted its receive WRs
        offset = 0
        for s in w.sg if remote is not None else ():
            local = self.fabric.mrs[s.lkey]
            there = remote.host_addr(w.remote_addr + offset)
            here = local.host_addr(s.addr)
            src, dst = (there, here) if read else (here, there)
            ctypes.memmove(dst, src, s.length)
            offset += s.length
        if w.opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM:
            recv = peer.recvs.popleft()
            peer.init.recv_cq.push(
                WC(
                    recv.wr_id,
                    e.IBV_WC_SUCCESS,
                    e.IBV_WC_RECV_RDMA_WITH_IMM,
                    peer.qp_num,
                    total,
                    w.imm_data,
                )
            )
        return e.IBV_WC_SUCCESS

    def close(self) -> None:
        self.fabric.qps.pop(self.qp_num, None)
        self.fabric.log.append(("destroy_qp", self.qp_num))


_WC_OPCODE = {
    e.IBV_WR_RDMA_READ: e.IBV_WC_RDMA_READ,
    e.IBV_WR_BIND_MW: e.IBV_WC_BIND_MW,
    e.IBV_WR_LOCAL_INV: e.IBV_WC_LOCAL_INV,
}


def _wr_record(w: SendWR) -> dict[str, Any]:
    if w.opcode == e.IBV_WR_BIND_MW:
        info = w.bind_info
        return {
            "wr_id": w.wr_id,
            "opcode": w.opcode,
            "send_flags": w.send_flags,
            "rkey": w.rkey,
            "bind": {"addr": info.addr, "length": info.length, "access": info.mw_access_flags},
        }
    return {
        "wr_id": w.wr_id,
        "opcode": w.opcode,
        "imm_data": w.imm_data,
        "send_flags": w.send_flags,
        "remote_addr": w.remote_addr,
        "rkey": w.rkey,
        "sg": [(s.addr, s.length, s.lkey) for s in w.sg],
    }


class FakeVerbs:
    """The verbs namespace RdmaTransport expects, bound to one simulated fabric."""

    e = e
    PyverbsError = PyverbsError
    PyverbsRDMAError = PyverbsRDMAError
    QPCap, QPInitAttr, QPAttr = QPCap, QPInitAttr, QPAttr
    GID, GlobalRoute, AHAttr = GID, GlobalRoute, AHAttr
    SGE, SendWR, RecvWR = SGE, SendWR, RecvWR
    PD, CQ, QP, MR, DmaBufMR = PD, CQ, QP, MR, DmaBufMR
    MW, MWBind, MWBindInfo = MW, MWBind, MWBindInfo

    def __init__(self, *devices: FakeDevice, no_devices: bool = False) -> None:
        self.fabric = Fabric(devices=[] if no_devices else list(devices or [FakeDevice()]))

    def get_device_list(self) -> list[SimpleNamespace]:
        if not self.fabric.devices:
            raise PyverbsRDMAError("Failed to get devices list", errno.ENODEV)
        return [SimpleNamespace(name=d.name.encode()) for d in self.fabric.devices]

    def Context(self, name: str) -> Context:  # a constructor in pyverbs
        return Context(self.fabric, name)
