"""Device and model specs: the numbers the cost model works from, kept as small JSON files.

The built-in specs live in ``specs/devices/*.json`` and ``specs/models/*.json`` next to this
module (shipped as package data); ``load_device`` and ``load_model`` take one of their names
(case-insensitive, e.g. ``h100``, ``llama-3-8b``) or the path of a JSON file of the same form, such
as the one ``kvmesh sim --calibrate`` writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.shared.config.json_object import json_object
from kvmesh.sim.mesh_terms import PACE_QUANTILES, Jitter, MeshOverheads

SPEC_DIR = Path(__file__).resolve().parent / "specs"


class SpecError(ValueError):
    """A spec that cannot be found or read; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class EngineScale:
    """How much slower (> 1) a worker of each role runs the engine inside the mesh than the
    in-process calibration (a step of that role costs its engine figures times the factor), and
    what a colocated or disagg decode step pays on top whatever it computes (``*_extra_s``: a
    fixed stall, its OpenMP threads waiting on one that the router or NATS preempted). A device
    spec holds one (``DeviceSpec.engine``); ``engine_scale.py`` fits it to the mesh's probe."""

    colocated: float = 1.0
    decode: float = 1.0
    prefill: float = 1.0
    colocated_extra_s: float = 0.0
    decode_extra_s: float = 0.0

    def apply(self, device: DeviceSpec) -> DeviceSpec:
        """``device`` with this scale in place of its own."""
        return dataclasses.replace(device, engine=self)

    def terms(self) -> tuple[tuple[str, str], ...]:
        """The terms as (role, value) for the tables calibration and the reports print."""
        return (
            ("colocated", f"x{self.colocated:.2f} + {self.colocated_extra_s * 1e3:.2f} ms"),
            ("decode", f"x{self.decode:.2f} + {self.decode_extra_s * 1e3:.2f} ms"),
            ("prefill", f"x{self.prefill:.2f}"),
        )


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator (or a CPU host) as the roofline sees it.

    ``peak_flops`` and ``mem_bandwidth`` are the datasheet peaks; a step's compute runs at
    ``peak_flops * flops_efficiency`` and its memory traffic at ``mem_bandwidth *
    bandwidth_efficiency`` (a calibrated spec stores effective figures and efficiencies of 1).
    ``cache_bytes``: the last-level cache (GPU L2, CPU LLC); weights that fit in it are not
    streamed from memory every step (a small model on a CPU), larger ones are.

    Fixed costs of a step, paid on top of the roofline (scheduling, kernel launches, sampling,
    Python): ``step_overhead_s`` once per step, ``seq_overhead_s`` per sequence in the step and
    ``chunk_overhead_s`` per prefill chunk (a slice of more than one new token).

    ``cores``: what workers sharing this device divide among their threads (a CPU host's cores;
    1 for an accelerator, shared equally); ``calibration_threads``: the threads the roofline
    figures were measured with (a calibrated CPU spec), so a worker with fewer cores computes
    proportionally slower. ``link_bandwidth`` (bytes/s) and ``link_latency_s``: the KV transfer
    link of one worker.

    ``mesh`` (a ``mesh_terms.MeshOverheads``): what the mesh adds to the engine on this host
    (its loop, token, request and hand-off overheads, each mode's jitter and pace, the wake and
    warm-up terms; ``overheads.py`` fits it; 0, and paces of 1, in the GPU specs).

    ``engine`` (an ``EngineScale``): how much slower each role's worker runs the engine inside
    the mesh than the in-process calibration the roofline and step figures come from, and the
    stall its step pays on top (``engine_scale.py`` fits it; 1 and 0 in the GPU specs, where
    nothing measured them).

    ``attention_flops`` and ``attention_bandwidth``: where a calibration found the attention
    running apart from the matmuls and slower than them (a CPU engine: its attention kernels
    reach ~10 % of the matmuls' FLOP/s and read the paged KV at a fraction of the weights'
    stream), the FLOP/s and KV bytes/s of that phase; a step then costs the matmuls' roofline
    (their FLOPs, the weights' bytes) plus the attention's (its FLOPs, the KV's bytes) rather
    than one roofline over both. 0 (the GPU specs): one roofline, as before."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    chunk_overhead_s: float = 0.0
    cache_bytes: float = 0.0
    cores: int = 1
    calibration_threads: int = 1
    link_latency_s: float = 0.0
    mesh: MeshOverheads = field(default_factory=MeshOverheads)
    engine: EngineScale = EngineScale()
    attention_flops: float = 0.0
    attention_bandwidth: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "memory_bytes", "link_bandwidth"):
            _require(getattr(self, name) > 0, self.name, name, "must be > 0")
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            _require(0 < getattr(self, name) <= 1, self.name, name, "must be in (0, 1]")
        for name in (
            "step_overhead_s",
            "seq_overhead_s",
            "chunk_overhead_s",
            "cache_bytes",
            "link_latency_s",
        ):
            _require(getattr(self, name) >= 0, self.name, name, "must be >= 0")
        m = self.mesh
        for f in dataclasses.fields(m):
            value = getattr(m, f.name)
            if isinstance(value, Jitter):
                knots = (value.p90_s, value.p99_s, value.max_s)
                what = f"mesh.{f.name}.p90_s, p99_s, max_s"
                _require(0 <= knots[0] <= knots[1] <= knots[2], self.name, what, _RISING)
                pace = f"mesh.{f.name}.pace"
                _require(len(value.pace) == len(PACE_QUANTILES), self.name, pace, _PACE_LEN)
                _require(value.pace[0] > 0, self.name, pace, "must start > 0")
                _require(list(value.pace) == sorted(value.pace), self.name, pace, _RISING)
            else:
                _require(value >= 0, self.name, f"mesh.{f.name}", "must be >= 0")
        for name in ("colocated", "decode", "prefill"):
            _require(getattr(self.engine, name) > 0, self.name, f"engine.{name}", "must be > 0")
        for name in ("colocated_extra_s", "decode_extra_s"):
            _require(getattr(self.engine, name) >= 0, self.name, f"engine.{name}", "must be >= 0")
        _require(
            (self.attention_flops > 0) == (self.attention_bandwidth > 0)
            and min(self.attention_flops, self.attention_bandwidth) >= 0,
            self.name,
            "attention_flops, attention_bandwidth",
            "must both be > 0 (a phase of its own) or both 0 (one roofline)",
        )
        for name in ("cores", "calibration_threads"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, self.name, name, "must be an int >= 1")

    def engine_scale(self, role: str) -> float:
        """The engine's slowdown in the mesh for a worker of ``role`` (colocated, decode or
        prefill)."""
        return getattr(self.engine, role)

    def engine_extra_s(self, role: str) -> float:
        """What a mesh step of ``role`` pays on top of its scaled engine figures (a colocated
        or decode worker's stall per step; 0 for a prefill worker)."""
        if role == "colocated":
            return self.engine.colocated_extra_s
        return self.engine.decode_extra_s if role == "decode" else 0.0

    def wake_s(self, role: str) -> float:
        """What the first step of a ``role`` worker that has idled ``cost.WAKE_AFTER_S`` or
        longer pays on top (a colocated or prefill worker; 0 for the others)."""
        if role == "colocated":
            return self.mesh.colocated_wake_s
        return self.mesh.prefill_wake_s if role == "prefill" else 0.0

    def warmup_s(self, role: str) -> float:
        """What a sequence's first decode step after its first token costs a ``role`` worker's
        step on top (``cost.WARMUP_STEPS`` steps, tapering; a colocated or decode worker, 0
        for a prefill worker)."""
        if role == "colocated":
            return self.mesh.colocated_warmup_s
        return self.mesh.decode_warmup_s if role == "decode" else 0.0

    def jitter_knots(self, role: str) -> tuple[float, float, float]:
        """The jitter's excess over the median gap at p90, p99 and at most, of a ``role``
        (colocated, or decode) worker's loop steps."""
        j = self.mesh.jitter_of(role)
        return j.p90_s, j.p99_s, j.max_s

    def pace_knots(self, role: str) -> tuple[float, ...]:
        """A ``role`` (colocated, or decode) worker's sequences' paces at the quantiles
        ``PACE_QUANTILES`` (0, 0.1, 0.5, 0.9, 1)."""
        return tuple(self.mesh.jitter_of(role).pace)

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-family decoder's shape; ``dtype_bytes`` of its weights and KV cache (2: bf16)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    description: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type == "int":
                _require(getattr(self, f.name) >= 1, self.name, f.name, "must be >= 1")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            self.name,
            "num_kv_heads",
            "must divide num_heads",
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the gated MLP (norms left out)."""
        h = self.hidden_size
        return (
            h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size
        )

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights (layers, embedding and untied LM head)."""
        params = self.num_layers * self.layer_params + 2 * self.lm_head_params
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes


_RISING = "must not decrease"
_PACE_LEN = f"must hold {len(PACE_QUANTILES)} knots (at quantiles {PACE_QUANTILES})"


def _require(ok: bool, spec: str, field: str, what: str) -> None:
    if not ok:
        raise SpecError(f"spec {spec!r}: {field} {what}")


def builtin_names(kind: str) -> list[str]:
    """The built-in specs of ``kind`` ("devices" or "models"), by file stem."""
    return sorted(p.stem for p in (SPEC_DIR / kind).glob("*.json"))


def _read(kind: str, name_or_path: str | Path) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.exists():
        path = SPEC_DIR / kind / f"{str(name_or_path).lower()}.json"
    if not path.exists():
        raise SpecError(
            f"no {kind[:-1]} spec {str(name_or_path)!r}: give a JSON file or one of "
            f"{', '.join(builtin_names(kind))}"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec ({exc})") from None
    return json_object(text, str(path), SpecError)


def _build(cls: type, data: dict[str, Any], source: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"{source}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise SpecError(f"{source}: {exc}") from None


def load_device(name_or_path: str | Path) -> DeviceSpec:
    data = _read("devices", name_or_path)
    source = str(name_or_path)
    for key, value in _leaves(data):
        if key not in ("name", "description") and not (
            isinstance(value, int | float) and math.isfinite(value)
        ):
            raise SpecError(f"device spec {source}: {key} must be a number, got {value!r}")
    stale = sorted(k for k in data if k not in {f.name for f in dataclasses.fields(DeviceSpec)})
    if stale:
        raise SpecError(
            f"{source}: unknown field(s) {', '.join(stale)} (a spec written before 2026-12-06 "
            "held the mesh overheads and engine scales as flat fields: they are now its mesh and "
            "engine objects, docs/sim.md; run kvmesh sim --calibrate again)"
        )
    engine = _build(EngineScale, _object(data.pop("engine", {}), source, "engine"), source)
    mesh = _object(data.pop("mesh", {}), source, "mesh")
    for key in ("jitter", "colocated_jitter"):
        if key in mesh:
            jitter = _object(mesh[key], source, f"mesh.{key}")
            if "pace" in jitter:
                jitter["pace"] = tuple(jitter["pace"])
            mesh[key] = _build(Jitter, jitter, f"{source} (mesh.{key})")
    mesh_terms = _build(MeshOverheads, mesh, f"{source} (mesh)")
    return _build(DeviceSpec, {**data, "engine": engine, "mesh": mesh_terms}, source)


def _object(value: Any, source: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"device spec {source}: {key} must be an object, got {value!r}")
    return value


def _leaves(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """A spec's values below its objects and lists, each with its dotted key."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _leaves(v, f"{key}.{k}" if key else k)]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _leaves(v, f"{key}[{i}]")]
    return [(key, value)]


def load_model(name_or_path: str | Path) -> ModelSpec:
    data = _read("models", name_or_path)
    for key, value in data.items():
        if key not in ("name", "description") and not isinstance(value, int):
            raise SpecError(f"model spec {name_or_path}: {key} must be an integer, got {value!r}")
    return _build(ModelSpec, data, str(name_or_path))


def write_device(spec: DeviceSpec, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")
    return path
