"""``shared/`` is grouped by plane (docs/ARCHITECTURE.md's module map) and the planes form layers:
a module imports only from its own plane and the planes below it, so the engine never reaches the
bus and the model never reaches the engine. Read from the source (every import, also the ones
inside functions; those under ``if TYPE_CHECKING:`` name types only and are left out), so a new
upward import fails here, not in review."""

from __future__ import annotations

import ast
import sys

from support.doc_blocks import ROOT

# Bottom to top: each plane may import the ones before it.
PLANES = ("config", "obs", "text", "kv", "transport", "model", "engine", "bus", "mesh")
# The kernels package sits beside model/: the forward pass and the engine's runner call it.
MAY_IMPORT_KERNELS = {"model", "engine"}
SHARED = ROOT / "shared"


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop the type-only blocks
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _target(module: str) -> str | None:
    """The plane (or 'kernels', 'services', ...) a kvmesh import lands in."""
    parts = module.split(".")
    if parts[0] != "kvmesh" or len(parts) < 2:
        return None
    if parts[1] == "shared":
        return parts[2] if len(parts) > 2 else "shared"
    return parts[1]


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(SHARED.rglob("*.py")):
        rel = path.relative_to(SHARED)
        plane = rel.parts[0] if len(rel.parts) > 1 else None
        if plane is None:
            if path.read_text().strip():
                bad.append(f"shared/{rel}: a loose module (put it in a plane)")
            continue
        allowed = set(PLANES[: PLANES.index(plane) + 1])
        if plane in MAY_IMPORT_KERNELS:
            allowed.add("kernels")
        for module in _imports(path):
            target = _target(module)
            if target is not None and target not in allowed:
                bad.append(f"shared/{rel} imports {module}")
    return bad


def test_every_shared_module_lives_in_a_plane():
    planes = {p.name for p in SHARED.iterdir() if (p / "__init__.py").is_file()}
    assert planes == set(PLANES)


def test_planes_import_only_downward():
    assert upward_imports() == []


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check itself: an engine module that imports the bus is reported."""
    for plane in PLANES:
        (tmp_path / plane).mkdir()
        (tmp_path / plane / "__init__.py").write_text("")
    (tmp_path / "engine" / "bad.py").write_text(
        "def f():\n    from kvmesh.shared.bus.messages.token_streams import TokenEvent\n"
    )
    (tmp_path / "kv" / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from kvmesh.shared.transport.base import Access\n"
    )
    (tmp_path / "transport" / "fine.py").write_text("from kvmesh.shared.kv.imm import pack_imm\n")
    monkeypatch.setattr(sys.modules[__name__], "SHARED", tmp_path)
    assert upward_imports() == [
        "shared/engine/bad.py imports kvmesh.shared.bus.messages.token_streams"
    ]
