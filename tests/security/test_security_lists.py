"""docs/security.md's two lists cannot drift (issue 40, "Done when"): the table of what each NATS
role may publish and read is the code's permissions (shared/bus/nats_auth.py role_permissions),
subject for subject; and every line of "What another local user can do" names the tests that
show it, each of which exists (pure: reads the doc, the code and the test files)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from kvmesh.shared.bus.nats_auth import QUEUE_KEEPER, inbox_prefix, role_permissions
from kvmesh.shared.config.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "security.md").read_text()
MESH = Subjects("m")

# JetStream API subjects, described in words in the table: each permission needs its words
JS_WORDS = {
    "$JS.API.INFO": "$JS.API.INFO",
    "$JS.API.STREAM.INFO.": "the stream's INFO",
    "$JS.API.STREAM.MSG.DELETE.": "MSG.DELETE",
    "$JS.API.CONSUMER.INFO.": "consumer's INFO",
    "$JS.API.CONSUMER.MSG.NEXT.": "MSG.NEXT",
    "$JS.ACK.": "acks of what it took",
}


def role_table() -> dict[str, tuple[str, str]]:
    """role -> (its "may publish" cell, its "may read" cell), from the table's rows."""
    start = DOC.index("| role | may publish")
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        roles, publish, read = (cell.strip() for cell in line.strip("|").split("|"))
        for role in roles.split(","):
            rows[role.split("(")[0].strip()] = (publish, read)
    return rows


def subjects_named(cell: str) -> set[str]:
    """The mesh subjects a cell names (``store.*.put/commit/get/release`` is four)."""
    found = set()
    for item in re.split(r",\s*", re.sub(r"\([^)]*\)", "", cell)):
        item = item.strip()
        if not re.fullmatch(r"[a-z_*>]+(\.[a-z_*>/]+)*", item):
            continue  # words (JetStream's, or "nothing but its own inbox")
        head, _, last = item.rpartition(".")
        found |= {f"{head}.{alt}" for alt in last.split("/")} if "/" in last else {item}
    return found


def described(
    permissions: tuple[str, ...], role: str, *, reads: bool
) -> tuple[set[str], list[str]]:
    """(mesh subjects without the prefix, JetStream subjects) of a role's permissions, without
    what the table names once for all ("besides its heartbeat and replies"): its heartbeat, its
    inbox, following the log level, $SRV discovery."""
    skip = {f"{MESH.prefix}.heartbeat.{role}.*", f"{inbox_prefix(role)}.>", "$SRV.>"}
    if reads:
        skip.add(MESH.CONTROL_LOG_LEVEL)
    mesh = {s.removeprefix(f"{MESH.prefix}.") for s in permissions if s.startswith(MESH.prefix)}
    mesh -= {s.removeprefix(f"{MESH.prefix}.") for s in skip}
    js = [s for s in permissions if s.startswith("$JS.")]
    other = set(permissions) - skip - {f"{MESH.prefix}.{s}" for s in mesh} - set(js)
    assert not other, f"{role}: permissions the table cannot show: {other}"
    return mesh, js


ROLES = sorted(set(role_permissions(MESH)) - {"admin"})


@pytest.mark.parametrize("role", ROLES)
def test_the_role_table_is_each_roles_permissions(role: str) -> None:
    table = role_table()
    assert role in table, f'docs/security.md: no row for role "{role}"'
    perms = role_permissions(MESH)[role]
    for column, cell, granted in (
        ("may publish", table[role][0], perms.publish),
        ("may read", table[role][1], perms.subscribe),
    ):
        mesh, js = described(granted, role, reads=column == "may read")
        named = subjects_named(cell)
        assert named == mesh, (
            f"docs/security.md, {role} {column}: missing {sorted(mesh - named)}, "
            f"not granted {sorted(named - mesh)}"
        )
        for subject in js:
            words = next(w for prefix, w in JS_WORDS.items() if subject.startswith(prefix))
            assert words in cell, f"docs/security.md, {role} {column}: say {words!r} ({subject})"


def test_the_keeper_row_says_it_reads_nothing_but_its_inbox() -> None:
    assert role_permissions(MESH)[QUEUE_KEEPER].subscribe == (f"{inbox_prefix(QUEUE_KEEPER)}.>",)
    assert "nothing but its own inbox" in role_table()[QUEUE_KEEPER][1]


def local_user_lines() -> list[str]:
    """The bullet lines (each joined with its continuation lines) of "What another local user
    can do"."""
    section = DOC[DOC.index("## What another local user can do") :]
    section = section[: section.index("\n## ", 1)]
    lines: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            lines.append(line[2:])
        elif line.startswith("  ") and lines:
            lines[-1] += " " + line.strip()
    return lines


def test_what_another_local_user_can_do_is_listed() -> None:
    lines = local_user_lines()
    assert len(lines) >= 10, lines
    for what in ("NATS", "kernel", "shm", "lane", "API key", "disk-path"):
        assert any(what in line for line in lines), f"no line about {what}"


def test_each_line_names_tests_that_exist() -> None:
    for line in local_user_lines():
        named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", line)
        assert named, f"docs/security.md, a local user's line names no test: {line[:80]}"
        for path, name in named:
            source = REPO / path
            assert source.is_file(), f"{path} (named for: {line[:60]}) does not exist"
            tests = {
                node.name
                for node in ast.walk(ast.parse(source.read_text()))
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            assert name in tests, f"{path} has no {name} (named for: {line[:60]})"
