"""What ``kvmesh up`` starts: the ``kvmesh serve ...`` command of every service, and how the
services share the cores (``cpu_plan.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from kvmesh.commands.cpu_plan import SPARE, CpuPlan, plan_cpus
from kvmesh.commands.up_config import UpConfig
from kvmesh.shared.config.nats_options import url_has_credentials


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # worker id, e.g. "decode-0"
    tier: str  # one of TIERS
    argv: tuple[str, ...]  # after `kvmesh`
    env: tuple[tuple[str, str], ...] = ()  # set for this child unless our environment sets it


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_plan(config: UpConfig, taken: frozenset[int] = frozenset()) -> CpuPlan:
    """How the workers share the cores (``cpu_plan.py``): the first ``--cores`` of those this
    process may run on, skipping ``taken`` (the cores other meshes' workers are pinned to:
    pinned_cores.py) where enough are left to partition (two, or ``--cores``), else as if none
    were taken (``pinned_cores.pinning_note`` says so)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    free = [cpu for cpu in allowed if cpu not in taken]
    if taken and len(free) >= max(2, config.cores or 0):
        allowed = free
    cores = config.cores or len(allowed)
    cpus = frozenset(allowed[:cores]) if cores <= len(allowed) else frozenset(range(cores))
    return plan_cpus(
        cpus,
        mode=config.mode,
        device=config.device,
        decode_workers=config.decode,
        prefill_workers=max(1, config.prefill),
        sharing=config.cpu_sharing,
        prefill_nice=config.prefill_nice,
        pinnable=cores <= len(allowed),
    )


def split_cores(config: UpConfig, cpus: CpuPlan | None = None) -> dict[str, int]:
    """Torch threads per worker of each role: ``{"decode": n, "prefill": m}`` (or colocated),
    as ``cpu_plan`` shares the cores out (``cpu_plan.py``); both modes use the same cores, so
    they compare on equal hardware."""
    cores = config.cores or available_cores()
    # Draft workers (when asked for) run a small model or none: a quarter of the cores.
    draft = {"draft": max(1, cores // 4 // config.draft_workers)} if config.draft else {}
    return {**(cpus or cpu_plan(config)).threads(), **draft}


def plan(
    config: UpConfig, nats_url: str, port: int, cpus: CpuPlan | None = None
) -> list[ChildSpec]:
    """The ``kvmesh serve ...`` command of every service, in start order (``cpus``: the cores'
    plan, made here from ``config`` alone when not given)."""
    cpus = cpus or cpu_plan(config)
    threads = split_cores(config, cpus)
    roles = cpus.roles
    assert config.mesh is not None
    common: tuple[str, ...] = ("--mesh", config.mesh)
    if not url_has_credentials(nats_url):  # else it reaches them in KVMESH_NATS_URL (ps shows argv)
        common += ("--nats-url", nats_url)
    for flag, path in (
        ("--nats-creds", config.nats_creds),
        ("--nats-tls-ca", config.nats_tls_ca),
        ("--nats-tls-cert", config.nats_tls_cert),
        ("--nats-tls-key", config.nats_tls_key),
    ):
        if path is not None:
            common += (flag, str(Path(path).resolve()))
    common += ("--log-level", config.log_level, "--log-format", config.log_format)
    engine = ("--model", config.model, "--device", config.device, "--transport", config.transport)
    if config.kv_cache_bytes is not None:
        engine += ("--kv-cache-bytes", str(config.kv_cache_bytes))
    prefill_kv = ("--kv-cache-dtype", config.kv_cache_dtype)
    decode_kv = ("--kv-cache-dtype", config.decode_kv_cache_dtype or config.kv_cache_dtype)
    worker = lambda name: ("--worker-id", name, *common)
    specs = [
        ChildSpec(
            "kv-registry-0", "kv-registry", ("serve", "kv-registry", *worker("kv-registry-0"))
        )
    ]
    if config.mode == "disagg":  # watches the JetStream queue (the launcher made it, as admin)
        name = "prefill-queue-0"
        specs.insert(0, ChildSpec(name, "kv-registry", ("serve", "prefill-queue", *worker(name))))
    decode_service = "colocated" if config.mode == "colocated" else "decode"
    decode_threads = roles[decode_service].flags()
    if config.mode == "disagg" and config.decode_pacing_ms:
        decode_threads += ("--min-step-interval-ms", str(config.decode_pacing_ms))
    if config.draft:
        decode_threads += ("--speculative",)
    # e.g. decode workers that share their cores with a lower-priority prefill pool: their
    # OpenMP threads wait for work asleep, not spinning on cores prefill could use
    decode_env = roles[decode_service].env
    for i in range(config.decode):
        name = f"{decode_service}-{i}"
        argv = ("serve", decode_service, *worker(name), *engine, *decode_kv, *decode_threads)
        if config.decode_tp > 1:  # N rank processes, one worker (docs/tp.md)
            argv += ("--tp", str(config.decode_tp))
        specs.append(ChildSpec(name, "decode", argv, decode_env))
    if config.mode == "disagg":
        for i in range(config.prefill):
            name = f"prefill-{i}"
            spare = SPARE in roles and i == config.prefill - 1  # cpu_plan.py: the spare one
            prefill_threads = roles[SPARE if spare else "prefill"].flags()
            argv = ("serve", "prefill", *worker(name), *engine, *prefill_kv, *prefill_threads)
            if config.draft == "early-exit":  # the draft workers take the prompts' draft KV
                argv += ("--draft-kv",)
            if config.draft == "model":  # ... computed here by the draft workers' checkpoint
                assert config.draft_model is not None
                argv += ("--draft-kv", "--draft-model", config.draft_model)
            if config.prefill_tp > 1:  # N rank processes, one worker (docs/tp.md)
                argv += ("--tp", str(config.prefill_tp))
            specs.append(ChildSpec(name, "prefill", argv))
    if config.draft:
        specs += draft_specs(config, worker, threads["draft"])
    for i in range(config.kv_store):
        name = f"kv-store-{i}"
        argv = ("serve", "kv-store", *worker(name), "--model", config.model)
        argv += ("--transport", config.transport)
        argv += ("--capacity-gb", f"{config.kv_store_capacity_gb:g}")
        if config.kv_store_disk_path is not None:  # absolute, as the TLS paths are
            argv += ("--disk-path", str(Path(config.kv_store_disk_path).expanduser().resolve()))
            argv += ("--disk-capacity-gb", f"{config.kv_store_disk_capacity_gb:g}")
        if config.kv_cache_dtype != "auto":  # the store's blocks are the workers' blocks
            argv += ("--kv-cache-dtype", config.kv_cache_dtype)
        specs.append(ChildSpec(name, "kv-store", argv))
    router = ("--model", config.model, "--port", str(port), "--host", config.host)
    if config.served_model_name is not None:
        router += ("--served-model-name", config.served_model_name)
    router += ("--mode", config.mode)
    if config.local_prefill_threshold is not None:
        router += ("--local-prefill-threshold", str(config.local_prefill_threshold))
    router += ("--tool-call-parser", config.tool_call_parser)
    if config.routers > 1:  # one port, the kernel spreads connections over the live ones
        router += ("--reuse-port",)
    for i in range(config.routers):
        name = f"router-{i}"
        specs.append(ChildSpec(name, "router", ("serve", "router", *worker(name), *router)))
    return specs


def draft_specs(config: UpConfig, worker, threads: int) -> list[ChildSpec]:
    """The ``kvmesh serve draft`` workers of ``--draft``."""
    assert config.draft is not None
    argv = ("--model", config.model, "--device", config.device, "--method", config.draft)
    argv += ("--num-speculative-tokens", str(config.num_speculative_tokens))
    argv += ("--threads", str(threads))
    if config.draft_tree:
        argv += ("--tree", ",".join(map(str, config.draft_tree)))
    if config.draft in ("early-exit", "model"):  # prompt KV from prefill workers
        argv += ("--transport", config.transport)
    if config.draft == "early-exit":
        argv += ("--exit-layer", str(config.draft_exit_layer))
    if config.draft == "model":
        assert config.draft_model is not None
        argv += ("--draft-model", config.draft_model)
    names = [f"draft-{i}" for i in range(config.draft_workers)]
    return [ChildSpec(n, "draft", ("serve", "draft", *worker(n), *argv)) for n in names]


def with_metrics_ports(specs: list[ChildSpec], ports: dict[str, int]) -> list[ChildSpec]:
    """Each spec named in ``ports`` serving its metrics there (the router serves them on its API
    port and is left as it is)."""
    return [
        replace(spec, argv=(*spec.argv, "--metrics-port", str(ports[spec.name])))
        if spec.name in ports
        else spec
        for spec in specs
    ]
