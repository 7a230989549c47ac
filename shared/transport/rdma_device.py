"""RDMA device discovery for the rdma backend: loading pyverbs, ``rdma_available()``, picking a
device / port / GID, and CUDA memory export as dma-buf. The ``"rdma"`` part of a descriptor is
``kv.descriptor.RdmaBackend``.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvmesh.shared.transport.errors import BackendUnavailableError

INSTALL_HINT = (
    "install rdma-core's Python bindings: scripts/install_pyverbs.sh (Debian/Ubuntu: apt-get "
    "install python3-pyverbs rdma-core ibverbs-providers, then link "
    "/usr/lib/python3/dist-packages/pyverbs into the venv); from PyPI, `pip install pyverbs` "
    "needs a system rdma-core at least as new as the wheel"
)
SOFTROCE_HINT = (
    "no RDMA NIC here? create a SoftRoCE device over an Ethernet interface: "
    "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`"
)
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs names the backend uses, as one namespace (tests pass a stand-in instead)."""
    mods = {
        n: importlib.import_module(f"pyverbs.{n}")
        for n in ("device", "pd", "cq", "qp", "wr", "mr", "addr", "enums", "pyverbs_error")
    }
    return SimpleNamespace(
        get_device_list=mods["device"].get_device_list,
        Context=mods["device"].Context,
        PD=mods["pd"].PD,
        CQ=mods["cq"].CQ,
        QP=mods["qp"].QP,
        QPCap=mods["qp"].QPCap,
        QPInitAttr=mods["qp"].QPInitAttr,
        QPAttr=mods["qp"].QPAttr,
        AHAttr=mods["addr"].AHAttr,
        GlobalRoute=mods["addr"].GlobalRoute,
        GID=mods["addr"].GID,
        MR=mods["mr"].MR,
        DmaBufMR=mods["mr"].DmaBufMR,
        MW=mods["mr"].MW,
        MWBind=mods["mr"].MWBind,
        MWBindInfo=mods["mr"].MWBindInfo,
        SGE=mods["wr"].SGE,
        SendWR=mods["wr"].SendWR,
        RecvWR=mods["wr"].RecvWR,
        e=mods["enums"],
        PyverbsError=mods["pyverbs_error"].PyverbsError,
        PyverbsRDMAError=mods["pyverbs_error"].PyverbsRDMAError,
    )


def require_pyverbs() -> SimpleNamespace:
    try:
        return load_pyverbs()
    except ImportError as exc:
        raise BackendUnavailableError(f"pyverbs is not importable ({exc}); {INSTALL_HINT}") from exc


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    name: str
    port: int
    port_attr: Any


def device_names(verbs: Any) -> list[str]:
    """Names of the RDMA devices; raises BackendUnavailableError when there are none."""
    try:
        devices = verbs.get_device_list()
    except verbs.PyverbsError as exc:  # "Failed to get devices list": no RDMA subsystem/devices
        raise BackendUnavailableError(
            f"no RDMA device: pyverbs says '{exc}'; {SOFTROCE_HINT}"
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise BackendUnavailableError(f"no RDMA device found; {SOFTROCE_HINT}")
    return names


def active_port(verbs: Any, ctx: Any) -> tuple[int, Any] | None:
    for port in range(1, ctx.query_device().phys_port_cnt + 1):
        attr = ctx.query_port(port)
        if attr.state == verbs.e.IBV_PORT_ACTIVE:
            return port, attr
    return None


def choose_device(verbs: Any, wanted: str | None) -> tuple[Any, DeviceChoice]:
    """Open ``wanted`` (or the first device with an active port): ``(context, choice)``."""
    names = device_names(verbs)
    if wanted is not None and wanted not in names:
        raise BackendUnavailableError(f"RDMA device {wanted!r} not found; devices here: {names}")
    for name in [wanted] if wanted else names:
        ctx = verbs.Context(name=name)
        found = active_port(verbs, ctx)
        if found is not None:
            return ctx, DeviceChoice(name, found[0], found[1])
        ctx.close()
    raise BackendUnavailableError(
        f"RDMA device(s) {[wanted] if wanted else names} have no active port; check the link "
        "(`rdma link`, `ibv_devinfo`); for SoftRoCE the netdev must be up"
    )


def rdma_available(verbs: Any = None, device: str | None = None) -> tuple[bool, str]:
    """Whether the rdma backend can run here, and if not, what is missing and how to fix it."""
    try:
        verbs = verbs or require_pyverbs()
        ctx, choice = choose_device(verbs, device)
    except BackendUnavailableError as exc:
        return False, str(exc)
    ctx.close()
    return True, f"RDMA device {choice.name} port {choice.port} is active"


def choose_gid(verbs: Any, ctx: Any, choice: DeviceChoice, wanted: int | None) -> tuple[int, str]:
    """``(gid_index, gid)``: ``wanted``, or on RoCE the first RoCEv2 IPv4-mapped GID (routable),
    else the first non-zero one."""
    if wanted is not None:
        return wanted, str(ctx.query_gid(choice.port, wanted).gid)
    candidates = []
    for idx in range(choice.port_attr.gid_tbl_len):
        try:
            gid = str(ctx.query_gid(choice.port, idx).gid)
        except verbs.PyverbsError:
            continue
        if gid != _ZERO_GID:
            candidates.append((idx, gid))
    if not candidates:
        raise BackendUnavailableError(
            f"RDMA device {choice.name} port {choice.port} has no GID; give the netdev an IP "
            "address (RoCE) or check the subnet manager (InfiniBand)"
        )
    if choice.port_attr.link_layer == verbs.e.IBV_LINK_LAYER_ETHERNET:
        for idx, gid in candidates:
            roce_v2 = ctx.query_gid_type(choice.port, idx) == verbs.e.IBV_GID_TYPE_SYSFS_ROCE_V2
            if roce_v2 and gid.startswith(_IPV4_MAPPED):
                return idx, gid
    return candidates[0]


# ---------------------------------------------------------------------------------------------------
# GPU memory as dma-buf

_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def cuda_dmabuf_export(ptr: int, length: int) -> tuple[int, int]:
    """Export ``[ptr, ptr+length)`` of CUDA memory as a dma-buf: ``(fd, offset of ptr in it)``.
    The caller closes the fd. Needs a driver with dma-buf support (CUDA >= 11.7, open kernel
    modules or nvidia-peermem-less dma-buf path)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise BackendUnavailableError(f"libcuda.so.1 not loadable ({exc}); no CUDA driver") from exc
    page = mmap.PAGESIZE
    base = ptr & ~(page - 1)
    end = (ptr + length + page - 1) & ~(page - 1)
    fd = ctypes.c_int(-1)
    rc = libcuda.cuMemGetHandleForAddressRange(
        ctypes.byref(fd),
        ctypes.c_uint64(base),
        ctypes.c_size_t(end - base),
        ctypes.c_int(_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD),
        ctypes.c_uint64(0),
    )
    if rc != 0:
        raise BackendUnavailableError(
            f"cuMemGetHandleForAddressRange failed with CUresult {rc}: this GPU/driver cannot "
            "export dma-bufs (needs CUDA >= 11.7 and a kernel with dma-buf; check "
            "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED); stage through host memory instead"
        )
    return fd.value, ptr - base
