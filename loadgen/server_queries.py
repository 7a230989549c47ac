"""What ``kvmesh bench serve`` asks the server it loads, over HTTP: the model it serves
(``/v1/models``), its ``/metrics`` samples and a kvmesh router's per-request timings
(``/v1/kvmesh/timings``); None or a clear ValueError where a server has none."""

from __future__ import annotations

from typing import Any


def _get_json(base_url: str, path: str, api_key: str | None, timeout_s: float) -> Any:
    """``GET base_url + path``'s JSON body (OSError: no answer; ValueError: not JSON)."""
    import urllib.request

    import orjson

    request = urllib.request.Request(f"{base_url.rstrip('/')}{path}")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return orjson.loads(resp.read())


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The model ``base_url`` serves: the first of its ``/v1/models``; ValueError saying what
    went wrong otherwise (the server is down, or lists none)."""
    try:
        models = _get_json(base_url, "/v1/models", api_key, timeout_s)["data"]
        return str(models[0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"could not ask {base_url}/v1/models which model it serves ({exc}); is the server "
            "up? Or name it with --model"
        ) from None


def scrape_metrics(
    base_url: str, api_key: str | None = None, timeout_s: float = 5.0
) -> dict[str, float] | None:
    """The server's ``/metrics`` samples, or None when it has none (not every server does)."""
    from kvmesh.loadgen import prom_text

    try:
        return prom_text.scrape(f"{base_url.rstrip('/')}/metrics", api_key, timeout_s)
    except (OSError, ValueError):
        return None


def fetch_timings(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> list[dict[str, Any]] | None:
    """A kvmesh router's latest per-request timings (``GET /v1/kvmesh/timings``), or None from
    a server without them."""
    try:
        body = _get_json(base_url, "/v1/kvmesh/timings", api_key, timeout_s)
    except (OSError, ValueError):
        return None
    requests = body.get("requests") if isinstance(body, dict) else None
    return requests if isinstance(requests, list) else None
