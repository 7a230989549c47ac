"""No dangling references in the guide and the docs: every relative Markdown link and every path
they name (`docs/load.md`, `services/router/app.py`, `../x.md`) resolves to a file or folder
inside the repository (issue 45: three docs cited a `../shared/ARCHITECTURE.md` the repository
does not have). A pure test: part of `make test-fast`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.doc_blocks import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("docs/", "shared/", "services/", "kvmesh/", "loadgen/", "kernels/", "tests/", "scripts/")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([A-Za-z0-9_./-]+)`")
# a path that climbs out of the folder it is written in, to a file (any text, quoted or not)
CLIMB = re.compile(r"(?<![A-Za-z0-9_./-])(?:\.\./)+[A-Za-z0-9_./-]*\.[a-z]+")


def _resolves(doc: Path, target: str) -> bool:
    """Whether ``target`` (from ``doc``'s folder, or the repository's root for a path that
    starts at a top folder) is a file or folder inside the repository; ``module.name`` (a
    module's attribute) counts when the module is."""
    bases = [doc.parent] if target.startswith("../") or not target.startswith(TOP) else [ROOT]
    candidates = [target]
    stem, dot, attr = target.rpartition(".")
    if dot and "/" not in attr and Path(target).suffix[1:] not in ("md", "py", "c", "toml"):
        candidates.append(stem + ".py")
    for base in bases:
        for candidate in candidates:
            path = (base / candidate.split("#")[0]).resolve()
            if path.is_relative_to(ROOT) and path.exists():
                return True
    return False


def _references(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    refs = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    refs += [t for t in CODE.findall(text) if t.startswith(TOP) and "*" not in t and "..." not in t]
    refs += CLIMB.findall(text)
    return refs


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_relative_link_and_path_in_the_docs_resolves_inside_the_repository(doc):
    dangling = sorted({ref for ref in _references(doc) if not _resolves(doc, ref)})
    assert dangling == [], f"{doc.relative_to(ROOT)} names what the repository does not have"


def test_link_check_catches_a_reference_outside_the_repository(tmp_path):
    doc = ROOT / "docs" / "load.md"
    assert not _resolves(doc, "../shared/ARCHITECTURE.md")  # /work/shared: outside the repo
    assert not _resolves(doc, "services/router/no_such_module.py")
    assert _resolves(doc, "ARCHITECTURE.md") and _resolves(doc, "shared/bus/nats_auth.new_password")
