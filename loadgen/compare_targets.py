"""What ``kvmesh bench serve --compare`` runs, and which colocated run is the baseline (pure).

``--compare`` lists targets run in turn on the same workload: ``colocated`` and ``disagg``
start a local mesh of that mode; ``URL`` or ``NAME=URL`` loads an OpenAI-compatible server the
benchmark did not start (e.g. llama.cpp's ``llama-server``), under ``NAME`` (default: its
host:port). ``colocated`` is run once per token budget of ``--colocated-budgets`` (its workers'
``--max-num-batched-tokens``), as ``colocated@BUDGET``; the comparison is made against the best
of them: the most goodput under ``--slo`` (without an SLO, the most output tokens/s), ties
broken by the lower TTFT p50.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

MESH_MODES = ("colocated", "disagg")


@dataclass(frozen=True, slots=True)
class Target:
    label: str
    mode: str | None = None  # a local mesh's mode; None: an outside server at url
    url: str | None = None
    budget: int | None = None  # colocated: its workers' per-step token budget (None: default)


def _check_url(url: str, item: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--compare {item!r}: expected a mode or an http(s)://HOST:PORT URL")
    return url.rstrip("/")


def parse_targets(text: str, colocated_budgets: Sequence[int] = ()) -> tuple[Target, ...]:
    """``"colocated,disagg,llama-server=http://127.0.0.1:8080"`` -> targets in order, the
    colocated one once per budget (or once, at its default, without budgets)."""
    targets: list[Target] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, rest = item.partition("=")
        if sep:
            if not name or name in MESH_MODES or "@" in name:
                raise ValueError(f"--compare {item!r}: NAME=URL needs a name that is not a mode")
            targets.append(Target(name, url=_check_url(rest, item)))
        elif "://" in item:
            url = _check_url(item, item)
            split = urllib.parse.urlsplit(url)
            targets.append(Target(f"{split.hostname}:{split.port or 80}", url=url))
        elif item == "colocated" and colocated_budgets:
            targets += [Target(f"colocated@{b}", "colocated", budget=b) for b in colocated_budgets]
        elif item in MESH_MODES:
            targets.append(Target(item, item))
        else:
            raise ValueError(
                f"--compare {item!r}: expected {' or '.join(MESH_MODES)}, a URL or NAME=URL"
            )
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--compare names a target twice: {text!r}")
    return tuple(targets)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"256,512,1024"`` -> (256, 512, 1024); each at least 16 (a block)."""
    budgets = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--colocated-budgets {text!r}: {part!r} is not a number") from None
        if value < 16:
            raise ValueError(f"--colocated-budgets: {value} is below one block (16 tokens)")
        budgets.append(value)
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"--colocated-budgets {text!r} repeats a budget")
    return tuple(budgets)


def sweep_score(goodput: float | None, output_tps: float, ttft_p50_ms: float | None) -> tuple:
    """Higher is better: goodput (else output tokens/s), then the lower TTFT p50."""
    first = goodput if goodput is not None else output_tps
    return (first, -(ttft_p50_ms if ttft_p50_ms is not None else float("inf")))
