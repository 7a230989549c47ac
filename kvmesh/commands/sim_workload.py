"""``kvmesh sim``'s workload flags: ``bench serve``'s named workloads (``--workload longtail``)
and prompt-length distributions (``--input-len-dist normal|lognormal``), resolved to the
simulated requests.

A flag given on the command line wins over the preset, and a flag neither gives keeps the
simulator's own default (``SIM_DEFAULTS``: long prompts on GPUs), as ``bench serve`` resolves its
presets; so ``kvmesh sim --workload longtail`` and ``kvmesh bench serve --workload longtail`` draw
the same lengths and arrival times for the same seed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvmesh.loadgen.arrivals import ARRIVAL_KINDS
from kvmesh.loadgen.length_dist import LENGTH_KINDS

if TYPE_CHECKING:
    from kvmesh.sim.workload import SimRequest

SIM_DEFAULTS: dict[str, Any] = {
    "num_requests": 300,
    "request_rate": 3.0,
    "arrival": "gamma",
    "burstiness": 0.5,
    "input_len_dist": "uniform",
    "input_len": 0,  # the mean of a normal or log-normal length
    "input_len_sd": None,
    "input_len_range": "8192:32768",
    "output_len_range": "512:512",
}


def register(load: argparse._ArgumentGroup) -> None:
    """The workload flags, on ``kvmesh sim``'s workload group (defaults None: resolved later)."""
    from kvmesh.loadgen.workload_presets import PRESETS

    load.add_argument(
        "--workload",
        choices=sorted(PRESETS),
        help="a named workload of `kvmesh bench serve` (its lengths, output and arrivals; "
        "flags given here win)",
    )
    load.add_argument("--num-requests", type=int, help="default 300")
    load.add_argument("--request-rate", type=float, help="req/s (default 3)")
    load.add_argument("--arrival", choices=ARRIVAL_KINDS, help="default gamma")
    load.add_argument("--burstiness", type=float, help="gamma shape (< 1: bursty; default 0.5)")
    load.add_argument(
        "--input-len-dist",
        choices=LENGTH_KINDS,
        help="prompt lengths: uniform over --input-len-range (default), or normal / lognormal "
        "with mean --input-len and sd --input-len-sd, clipped to --input-len-range",
    )
    load.add_argument("--input-len", type=int, help="normal, lognormal: the mean prompt length")
    load.add_argument("--input-len-sd", type=float, help="normal, lognormal: its sd")
    load.add_argument("--input-len-range", help="MIN:MAX prompt tokens (default 8192:32768)")
    load.add_argument("--output-len-range", help="MIN:MAX output tokens (default 512:512)")


def resolve(args: argparse.Namespace) -> None:
    """Fill every workload flag left out: from ``--workload``'s preset, else ``SIM_DEFAULTS``."""
    from kvmesh.loadgen.workload_presets import PRESETS

    preset = PRESETS[args.workload] if args.workload else None
    from_preset: dict[str, Any] = {}
    if preset is not None:
        from_preset = {
            "num_requests": preset.num_prompts,
            "request_rate": None if preset.request_rate is None else float(preset.request_rate),
            "arrival": preset.arrival,
            "burstiness": preset.burstiness,
            "input_len_dist": preset.input_len_dist,
            "input_len": preset.input_len,
            "input_len_sd": preset.input_len_sd,
            "input_len_range": preset.input_len_range,
            "output_len_range": None
            if preset.output_len is None
            else f"{preset.output_len}:{preset.output_len}",
        }
    for name, default in SIM_DEFAULTS.items():
        if getattr(args, name) is None:
            value = from_preset.get(name)
            setattr(args, name, default if value is None else value)


def requests(args: argparse.Namespace, rate: float | None = None) -> list[SimRequest]:
    """The simulated requests of the (resolved) flags, sent at ``rate`` (default
    ``--request-rate``); a trace's own times when ``--trace`` is given."""
    from kvmesh.loadgen.arrivals import ArrivalProcess
    from kvmesh.loadgen.length_dist import LengthDistribution
    from kvmesh.loadgen.workload import LengthSpec
    from kvmesh.sim import workload

    if args.trace is not None:
        return workload.from_trace(args.trace, args.num_requests)
    lengths = LengthDistribution.parse(
        args.input_len_dist,
        args.input_len,
        args.input_len_range,
        args.input_len_sd,
    )
    return workload.synthetic(
        ArrivalProcess(args.arrival, args.request_rate if rate is None else rate, args.burstiness),
        args.num_requests,
        lengths,
        LengthSpec.parse(0, args.output_len_range),
        args.seed,
    )
