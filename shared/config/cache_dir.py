"""kvmesh's cache folder, shared by what it builds or fetches once per machine (the compiled CPU
kernels, imported models): ``$KVMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmesh``, else
``~/.cache/kvmesh``; a per-user folder under the temp directory where there is no home."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "KVMESH_CACHE_DIR"


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return temp_cache_dir()
    return Path(base) / "kvmesh"


def temp_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kvmesh-cache-{os.getuid()}"
