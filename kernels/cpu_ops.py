"""The float32 CPU kernels of ``cpu_ops.c`` (elementwise work and decode attention),
``cpu_linear.c`` (linear layers over prepacked weights) and ``cpu_layer.c`` (a whole decoder
layer's decode step in one call and one OpenMP region), built with the system C compiler into one
library and called through ctypes.

``load_cpu_ops()`` compiles the sources once per machine (``-O3 -march=native``) into a cache
folder (``$KVMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmesh``, else ``~/.cache/kvmesh``), keyed
by a hash of the sources, the flags and the CPU's feature flags, and returns a ``CpuOps``; with no
compiler it returns None and says why in the log, and the engine keeps its pure-torch path.
A cache folder is used only when it is this user's, ``0700``, on a path no one else can change,
and a built library only when it is this user's and writable by no one else
(``shared/config/private_path.py``); otherwise the next folder is tried (the per-user temp
folder), and last a fresh private folder of this process's own, built anew.
Each wrapper checks shapes, strides and dtypes; ``*_reference`` are the torch definitions the
tests hold the kernels to. Decode attention splits its batch into runs of sequences with about
equal context (``split_by_work``), one per torch thread, run on the OpenMP threads torch itself
uses (the library is built with ``-fopenmp`` and binds to the libgomp already loaded). It reads a
float32, float16 or bfloat16 cache (widened to float32 in registers) or an fp8/int8 one with its
scales, each (sequence, KV head)'s context in chunks of 256 positions whose partial softmax
results fold in order; the fused layers (``cpu_layer.c``) split the chunks themselves over the
threads, so that batch 1 keeps every thread busy, with the same result bit for bit.

This module builds and loads the library; ``CpuOps`` is in ``cpu_bindings.py`` (the fused layers'
call arguments in ``cpu_layer_args.py``), the references in ``cpu_references.py``, the kernels'
argument layouts (packed weights, layer views, ``DecodePlan``) in ``cpu_plans.py``. Every name callers use is importable from here.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
from kvmesh.kernels.cpu_bindings import CpuOps
from kvmesh.kernels.cpu_plans import (
    MAX_TREE_TAIL,
    PANEL_WIDTH,
    DecodeLayerKV,
    DecodeLayerWeights,
    DecodePlan,
    KVQuant,
    KVTree,
    PackedWeight,
    QuantDecodeLayerWeights,
    decode_plan,
    pack_linear_weight,
    split_by_work,
)
from kvmesh.kernels.cpu_references import (
    linear_reference,
    rms_norm_reference,
    silu_mul_reference,
)
from kvmesh.shared.config.cache_dir import cache_dir
from kvmesh.shared.config.cache_dir import temp_cache_dir as _temp_cache_dir
from kvmesh.shared.config.private_path import (
    UntrustedPathError,
    fresh_private_dir,
    private_dir,
    trusted_file,
)

__all__ = [
    "CFLAGS",
    "HEADERS",
    "MAX_TREE_TAIL",
    "OPENMP",
    "PANEL_WIDTH",
    "SOURCES",
    "CpuOps",
    "CpuOpsBuildError",
    "DecodeLayerKV",
    "DecodeLayerWeights",
    "DecodePlan",
    "KVQuant",
    "KVTree",
    "PackedWeight",
    "QuantDecodeLayerWeights",
    "build",
    "decode_plan",
    "linear_reference",
    "load_cpu_ops",
    "pack_linear_weight",
    "rms_norm_reference",
    "silu_mul_reference",
    "split_by_work",
]

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_ops.c",
        "cpu_linear.c",
        "cpu_layer.c",
        "cpu_quant.c",
        "cpu_kquant.c",
        "cpu_dequant.c",
    )
)
# the headers the sources include (cpu_kernels.h: every one), part of the build's cache key
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.h", "cpu_vec.h"))
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
# the decode attention's parts run on the process's OpenMP threads (torch's runtime); a compiler
# without OpenMP builds the library without it, and the parts run one after another
OPENMP = "-fopenmp"


class CpuOpsBuildError(RuntimeError):
    """The C compiler is missing or failed; the message has its output."""


def _cpu_fingerprint() -> str:
    """The CPU feature flags -march=native compiles for (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build(directory: Path | None = None, compiler: str | None = None) -> Path:
    """Compile ``cpu_ops.c`` unless the cache has it; returns the shared library's path."""
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise CpuOpsBuildError(f"no C compiler {cc!r} on PATH (install gcc, or set CC)")
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(
        source + " ".join((*CFLAGS, OPENMP)).encode() + cc.encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    name = f"kvmesh_cpu_ops-{key}.so"
    if directory is not None:
        return _compile(cc, _trusted_folder(directory) / name)
    # The library is loaded into this process: a folder or a file another user can change is
    # never used (issue 40), and a read-only or broken cache folder is skipped too.
    for folder in (cache_dir, _temp_cache_dir):
        try:
            return _compile(cc, _trusted_folder(folder()) / name)
        except UntrustedPathError as exc:
            _log().warning("kernel_cache_untrusted", reason=str(exc), fallback="next folder")
        except OSError:
            continue
    private = fresh_private_dir("kvmesh-kernels-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)  # a loaded library may go
    return _compile(cc, private / name)


def _trusted_folder(directory: Path) -> Path:
    """``directory`` made or checked as a private folder of this user's (``private_dir``)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    return private_dir(directory)


def _log():
    return structlog.get_logger("kvmesh.kernels")


def _compile(cc: str, target: Path) -> Path:
    if trusted_file(target):
        return target
    directory = target.parent
    # Several processes may build at once: each compiles to its own name, then renames.
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        for flags in ((*CFLAGS, OPENMP), CFLAGS):  # without OpenMP where the compiler has none
            result = subprocess.run(
                [cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode == 0:
                break
        else:
            raise CpuOpsBuildError(
                f"{cc} failed on {' '.join(map(str, SOURCES))}:\n{result.stderr.strip()}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_cpu_ops() -> CpuOps | None:
    """The process's CpuOps, built on first use; None (logged once) when it cannot be built."""
    try:
        return CpuOps(build())
    except (CpuOpsBuildError, OSError) as exc:
        _log().warning("cpu_ops_unavailable", reason=str(exc), fallback="torch decode path")
        return None
