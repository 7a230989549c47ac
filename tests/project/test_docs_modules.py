"""docs/ARCHITECTURE.md's module map names every module of the code, so a module added without
a line there (or a map that still names a removed one's folder) is caught."""

from __future__ import annotations

import re

from support.doc_blocks import ROOT, SOURCE_FOLDERS, fenced_block


def _module_map() -> str:
    return fenced_block("ARCHITECTURE.md", r"## Module map\n.*?```\n")


def _modules() -> set[str]:
    names = set()
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".c") and path.stem not in ("__init__", "__main__"):
                names.add(path.stem)
    return names


def test_module_map_names_every_module():
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _module_map()))
    assert sorted(_modules() - words) == []


def test_module_map_names_every_service():
    services = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    block = _module_map()
    assert sorted(s for s in services if f"{s}/" not in block) == []
