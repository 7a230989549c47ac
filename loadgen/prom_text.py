"""One reader of Prometheus text (a service's ``/metrics``) for the benchmarks and the tests, on
prometheus_client's own parser.

Each line is parsed on its own, so a malformed line (another server's, or a truncated read) is
skipped rather than losing the rest of the page. A sample keeps the name it is exposed under (a
counter's ``_total`` included). Three views:

- ``totals``: by name, a labelled series summed over its labels; histogram buckets and
  ``_created`` timestamps left out (what a before/after difference wants);
- ``series``: every sample, keyed ``name`` or ``name{label="value",...}`` in exposition order
  (what a test asserting one labelled series wants);
- ``samples``: the parser's samples themselves (name, labels, value), for anything else.

``scrape(url)`` reads a page and gives its totals.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> Iterator[Sample]:
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            for family in text_string_to_metric_families(line + "\n"):
                yield from family.samples
        except ValueError:
            continue


def totals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name.endswith(("_bucket", "_created")):
            continue
        out[s.name] = out.get(s.name, 0.0) + s.value if s.labels else float(s.value)
    return out


def series(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples(text):
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
        out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def fetch(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The page at ``url`` (a ``/metrics`` URL); an OSError when it cannot be read."""
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8", "replace")


def scrape(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, float]:
    """``totals`` of the page at ``url``."""
    return totals(fetch(url, api_key, timeout_s))
