"""No two classes of the product share a name: a reader (or a log line, or a traceback) that says
``Admission`` means one type. Module-private ones (``_Job``) are left out."""

from __future__ import annotations

import re
import sys
from collections import defaultdict

from support.doc_blocks import ROOT, SOURCE_FOLDERS

CLASS = re.compile(r"^class ([A-Za-z]\w*)", re.M)


def _public_classes() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in CLASS.findall(path.read_text()):
                where[name].append(str(path.relative_to(ROOT)))
    return where


def test_no_two_product_classes_share_a_name():
    shared = {name: paths for name, paths in _public_classes().items() if len(paths) > 1}
    assert shared == {}


def test_a_shared_name_is_caught(tmp_path, monkeypatch):
    """The check itself: a second ``Admission`` in another package is reported."""
    for folder in SOURCE_FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "shared" / "a.py").write_text("class Admission:\n    pass\n")
    (tmp_path / "services" / "b.py").write_text("class Admission(Base):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _public_classes()["Admission"] == ["shared/a.py", "services/b.py"]
