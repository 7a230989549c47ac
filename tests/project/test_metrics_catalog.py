"""The Grafana dashboard and docs/metrics.md against the metrics the services register (read from
their metrics modules: no running stack needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from support.metrics_catalog import catalog, markdown_table, series_names

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvmesh.json"
DATASOURCES = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
METRIC = re.compile(r"\bkvmesh_[a-z0-9_]+")


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_every_dashboard_panel_queries_metrics_the_services_register() -> None:
    known = series_names()
    uids = {d["uid"] for d in yaml.safe_load(DATASOURCES.read_text())["datasources"]}
    unknown: dict[str, list[str]] = {}
    for panel in panels():
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids, panel["title"]
            names = METRIC.findall(target["expr"])
            assert names, f"{panel['title']!r}: {target['expr']!r} names no kvmesh metric"
            missing = [n for n in names if n not in known]
            if missing:
                unknown.setdefault(panel["title"], []).extend(missing)
    assert unknown == {}, f"dashboard panels query metrics no service registers: {unknown}"


def test_dashboard_shows_every_service() -> None:
    queried = {n for p in panels() for t in p["targets"] for n in METRIC.findall(t["expr"])}
    for service in ("router", "registry", "prefill", "decode"):
        assert any(n.startswith(f"kvmesh_{service}_") for n in queried), service


def test_metric_names_are_unique_across_services() -> None:
    names = [doc.name for doc in catalog()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_metrics_page_lists_every_metric_as_the_modules_define_it() -> None:
    page = (REPO / "docs" / "metrics.md").read_text()
    assert markdown_table() in page, (
        "docs/metrics.md's table is out of date; replace it with the output of "
        "`python tests/support/metrics_catalog.py`"
    )


def test_the_docs_name_only_metrics_the_services_register() -> None:
    """Every kvmesh_* name in the README and docs/ is a metric (a family or one of its series)
    some service registers, or a prefix naming a group (``kvmesh_draft_``): a stray or stale
    name next to the table, which the table check alone lets through, fails here."""
    known = series_names() | {doc.name for doc in catalog()}
    stray = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        names = {n for n in METRIC.findall(path.read_text()) if not n.endswith("_")}
        if names - known:
            stray[path.name] = sorted(names - known)
    assert stray == {}, f"metric names no service registers: {stray}"
