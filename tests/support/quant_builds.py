"""The quantized-linear kernels (kernels/cpu_quant.c, cpu_kquant.c) built on their own for an
instruction set other than this CPU's (``-march=haswell``: AVX2; ``-march=x86-64``: the portable
scalar loops), bound through ctypes: the code paths the default ``-march=native`` build does not
take on an AVX-512 machine."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import torch
from kvmesh.kernels.cpu_ops import SOURCES
from kvmesh.kernels.cpu_plans import quant_scale_stride


def build_quant_lib(directory: Path, march: str = "x86-64") -> ctypes.CDLL:
    """cpu_quant.c and cpu_kquant.c compiled with ``-march=march`` (x86 only; elsewhere the
    compiler's default target) into ``directory``; ``kv_qlinear`` bound."""
    sources = [str(p) for p in SOURCES if p.name in ("cpu_quant.c", "cpu_kquant.c")]
    lib_path = directory / f"quant-{march}.so"
    target = [f"-march={march}"] if platform.machine() in ("x86_64", "AMD64") else []
    flags = ["-O2", *target, "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11"]
    subprocess.run(["cc", *flags, "-o", str(lib_path), *sources, "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kv_qlinear.argtypes = (p, i64, i64, ctypes.c_int, p, i64, p, p, p, p, i64)
    lib.kv_qlinear.restype = None
    return lib


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(flags) <= set(line.split())


def qlinear(lib: ctypes.CDLL, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ w.T (+ bias) through ``lib``'s kv_qlinear on one thread (w: a QuantWeight or
    StackedWeight)."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, quant_scale_stride(k))
    y = torch.empty(m, weight.rows)
    lib.kv_qlinear(
        x.data_ptr(), m, k, weight.code, weight.data.data_ptr(), weight.rows,
        None if bias is None else bias.data_ptr(), y.data_ptr(), xq.data_ptr(), xs.data_ptr(), 1,
    )  # fmt: skip
    return y
