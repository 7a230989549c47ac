"""What the docs tests read: the repository's source folders and one fenced block of a doc."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("shared", "services", "kvmesh", "kernels", "loadgen", "sim")


def fenced_block(doc: str, opening: str) -> str:
    """The body of the first fenced block in ``docs/<doc>`` matched by ``opening`` (a regex for
    what comes before the body, e.g. a heading and the fence)."""
    text = (ROOT / "docs" / doc).read_text()
    match = re.search(opening + r"(.*?)```", text, re.S)
    assert match, f"docs/{doc} has no block matching {opening!r}"
    return match.group(1)
