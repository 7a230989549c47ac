"""Named workloads of ``kvmesh bench serve --workload NAME`` (pure: flag values, no I/O).

A preset gives the workload and arrival flags a value; a flag given on the command line wins over
the preset, and a flag neither gives keeps its built-in default (``BUILTIN``).

- ``longtail``: the outside load tester's workload of issue 42: prompt lengths normal(mean
  1,500, sd 700 tokens) clipped to [128, 4,800], text cut from the shipped corpus, sent to
  /v1/completions streamed with ``ignore_eos`` and 96 output tokens, gamma arrivals of shape 0.5
  at 0.4 req/s, 40 requests after 2 warm-up requests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkloadPreset:
    """Values for ``bench serve``'s flags, by argparse ``dest``; None: the preset leaves it."""

    description: str
    num_prompts: int | None = None
    input_len: int | None = None
    input_len_dist: str | None = None
    input_len_sd: float | None = None
    input_len_range: str | None = None
    output_len: int | None = None
    prompt_format: str | None = None
    prompt_source: str | None = None
    endpoint: str | None = None
    arrival: str | None = None
    burstiness: float | None = None
    request_rate: str | None = None
    warmups: int | None = None


PRESETS: dict[str, WorkloadPreset] = {
    "longtail": WorkloadPreset(
        description="normal(1500, 700) prompt tokens in [128, 4800], corpus text, 96 output "
        "tokens, gamma(shape 0.5) arrivals at 0.4 req/s, 40 requests after 2 warm-ups",
        num_prompts=40,
        input_len=1500,
        input_len_dist="normal",
        input_len_sd=700.0,
        input_len_range="128:4800",
        output_len=96,
        prompt_format="text",
        prompt_source="corpus",
        endpoint="/v1/completions",
        arrival="gamma",
        burstiness=0.5,
        request_rate="0.4",
        warmups=2,
    ),
}

# Defaults of the flags a preset may set, where no preset sets them (argparse's defaults are
# None so that a flag given on the command line can be told from one left out).
BUILTIN: dict[str, Any] = {
    "input_len": 128,
    "input_len_dist": "uniform",
    "prompt_format": "ids",
    "prompt_source": "random",
    "endpoint": "/v1/completions",
    "arrival": "poisson",
    "burstiness": 1.0,
    "warmups": 1,
}

PRESET_FLAGS = tuple(f.name for f in fields(WorkloadPreset) if f.name != "description")


def apply_preset(args: argparse.Namespace, name: str | None) -> None:
    """Fill every preset flag left out on the command line: from preset ``name`` (None: no
    preset), else from ``BUILTIN``; a ValueError names an unknown preset."""
    preset = None
    if name is not None:
        preset = PRESETS.get(name)
        if preset is None:
            raise ValueError(f"--workload {name!r}: expected one of {', '.join(PRESETS)}")
    for flag in PRESET_FLAGS:
        if getattr(args, flag, None) is not None:
            continue
        value = getattr(preset, flag) if preset is not None else None
        setattr(args, flag, value if value is not None else BUILTIN.get(flag))
