"""pytest side of scripts/netns_mesh.py: ``netns_mesh_or_skip`` yields a three-host mesh, or
skips saying why this machine cannot build one (no root / CAP_NET_ADMIN, no iproute2)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> Any:
    """scripts/<name>.py as a module named ``name`` (scripts/ is no package), loaded once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_netns_mesh() -> Any:
    """scripts/netns_mesh.py as a module."""
    return load_script("netns_mesh")


@contextlib.contextmanager
def netns_mesh_or_skip(**kwargs: Any) -> Iterator[Any]:
    """``netns_mesh(**kwargs)``; delay/loss come from netem, or from tap_link.py where the kernel
    has no sch_netem, and are dropped (with a warning) only where neither works."""
    harness = load_netns_mesh()
    reason = harness.why_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    if (
        kwargs.get("delay_ms") or kwargs.get("loss_pct")
    ) and not harness.link_emulation_available():
        import warnings

        warnings.warn(
            "no sch_netem and no /dev/net/tun: the multi-host mesh runs without link delay/loss",
            stacklevel=2,
        )
        kwargs = {**kwargs, "delay_ms": 0.0, "loss_pct": 0.0}
    with harness.netns_mesh(**kwargs) as mesh:
        yield mesh
