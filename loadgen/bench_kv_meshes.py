"""The meshes ``kvmesh bench kv --multi-turn`` compares (loadgen/bench_kv_turns.py's docstring):
``plain`` and ``store``, what each turns on or off (``--baseline``), their ``kvmesh up`` configs,
and both started together and stopped together."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Variant:
    """One of the two meshes: its store count, the KVMESH_* settings every service gets, and
    what it turns off (said in the JSON)."""

    name: str
    kv_store: int
    env: Mapping[str, str]
    description: str


def variants(baseline: str, local_max_suffix_tokens: int | None = None) -> tuple[Variant, Variant]:
    """(plain, store): plain runs first. ``local_max_suffix_tokens``: the store mesh's registry
    setting (None: its default, 512; 0: every request is prefilled by a prefill worker, which
    reads what its cache lacks from the store)."""
    suffix = "local_max_suffix_tokens (512)"
    store_env = {}
    if local_max_suffix_tokens is not None:
        store_env["KVMESH_LOCAL_MAX_SUFFIX_TOKENS"] = str(local_max_suffix_tokens)
        suffix = f"local_max_suffix_tokens ({local_max_suffix_tokens}; 0: never)"
    store = Variant(
        "store",
        1,
        store_env,
        "kv-store 1 (prefill workers read and put prefixes, decode workers put finished "
        "requests); kv-registry prefix-aware placement on, local prefill of a cached prefix on "
        f"the decode worker holding it when <= {suffix} are left",
    )
    if baseline == "no-reuse":
        env = {
            "KVMESH_PREFIX_WEIGHT": "0",
            "KVMESH_ENABLE_PREFIX_CACHING": "0",
            "KVMESH_USE_KV_STORE": "0",
        }
        text = (
            "no kv-store; kv-registry prefix-aware placement off (prefix_weight 0: by load "
            "only, no local prefill of a cached prefix); every engine's prefix cache off "
            "(every prompt computed whole)"
        )
    elif baseline == "routing":
        env = {}
        text = (
            "no kv-store; kv-registry prefix-aware placement on (its defaults: a request goes "
            "to the decode worker caching most of its prompt, which prefills the rest locally "
            "when it is short), every engine's prefix cache on: the store's own gain"
        )
    else:
        env = {"KVMESH_PREFIX_WEIGHT": "0"}
        text = (
            "no kv-store; kv-registry prefix-aware placement off (prefix_weight 0: by load "
            "only, no local prefill of a cached prefix); each engine keeps its own prefix cache"
        )
    return Variant("plain", 0, env, text), store


def mesh_config(variant: Variant, args: argparse.Namespace) -> Any:
    """The UpConfig of ``variant``'s mesh: disagg, a NATS server and a mesh name of its own."""
    from kvmesh.testing.mesh import mesh_config

    return mesh_config(
        model=args.model,
        mesh=f"kvbench-{variant.name}",  # two meshes in one process: their state files differ
        mode="disagg",
        transport=args.transport,
        local_prefill_threshold=0,  # only the registry's prefix routing prefills on decode
        prefill=args.prefill_workers,
        decode=args.decode_workers,
        prefill_nice=args.prefill_nice,
        decode_pacing_ms=args.decode_pacing_ms,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_store=variant.kv_store,
        kv_store_capacity_gb=args.kv_store_capacity_gb,
        startup_timeout_s=args.startup_timeout_s,
    )


@contextlib.contextmanager
def started_meshes(variants: Sequence[Variant], args: argparse.Namespace) -> Iterator[list[Any]]:
    """Every variant's mesh, started at once and waited for together (one start-up's time, not
    one per mesh); stopped together on exit. Only one of them is loaded at a time: the other
    idles (heartbeats)."""
    from kvmesh.testing.mesh import start_launcher

    launchers: list[Any] = []
    try:
        for variant in variants:
            env = {"KVMESH_BLOCK_SIZE": str(args.block_size), **variant.env}
            launchers.append(start_launcher(mesh_config(variant, args), env))

        async def ready() -> None:
            await asyncio.gather(*(launcher.wait_ready() for launcher in launchers))

        asyncio.run(ready())
        yield launchers
    finally:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(launchers))) as pool:
            list(pool.map(lambda launcher: launcher.stop(), launchers))
