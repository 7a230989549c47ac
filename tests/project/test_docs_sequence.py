"""The request sequence diagram in docs/mesh.md names real code: every ``Class.method`` in it is a
method of a class defined in kvmesh's sources, and every subject template is one Subjects makes,
so the diagram cannot drift from the code unnoticed."""

from __future__ import annotations

import ast
import re

from kvmesh.shared.config.subjects import Subjects
from support.doc_blocks import ROOT, SOURCE_FOLDERS, fenced_block


def _diagram() -> str:
    return fenced_block("mesh.md", r"```mermaid\n(?=sequenceDiagram)")


def _methods_by_class() -> dict[str, set[str]]:
    """Each class's methods, its own and those it inherits from kvmesh classes (by base name)."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {
                        n.name
                        for n in node.body
                        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                    }
                    own.setdefault(node.name, set()).update(names)
                    bases.setdefault(node.name, set()).update(
                        b.id if isinstance(b, ast.Name) else b.value.id
                        for b in node.bases
                        if isinstance(b, ast.Name)
                        or (isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name))
                    )

    def inherited(cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        found = set(own.get(cls, set()))
        for base in bases.get(cls, set()) - seen - {cls}:
            found |= inherited(base, seen | {cls})
        return found

    return {cls: inherited(cls) for cls in own}


def test_every_method_the_sequence_diagram_names_exists():
    methods = _methods_by_class()
    named = re.findall(r"\b([A-Z][A-Za-z]+)\.([A-Za-z_]\w*)", _diagram())
    assert named, "the diagram names no functions"
    missing = [f"{cls}.{fn}" for cls, fn in named if fn not in methods.get(cls, set())]
    assert missing == []


def test_every_subject_the_sequence_diagram_names_is_one_subjects_makes():
    s = Subjects("zz9")
    made = {
        subject.replace("zz9", "<mesh>").replace("qq7", "<id>")
        for subject in (
            s.REGISTRY_PLACE,
            s.decode_reserve("qq7"),
            s.request_tokens("qq7"),
            s.PREFILL_STREAM,
        )
    }
    named = set(re.findall(r"kvmesh\.<mesh>\.[\w.<>]+|KVMESH_PREFILL_<mesh>", _diagram()))
    assert named and named <= made, named - made
