"""A JSON file's text read as an object, or one clear error naming the file."""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, where: str, error: type[Exception]) -> dict[str, Any]:
    """``text`` (from ``where``, a file) parsed as a JSON object; else ``error`` with
    "<where>: invalid JSON: ..." or "<where>: expected a JSON object, got <type>"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value
