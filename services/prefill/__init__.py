"""Prefill service: chunked prefill of prompts whose KV goes straight into a decode worker's
reserved blocks, one batched one-sided write per chunk, overlapped with the next chunk."""

from kvmesh.services.prefill.config import PrefillConfig

CONFIG = PrefillConfig


async def run(config: PrefillConfig) -> None:
    from kvmesh.services.prefill.service import run as run_service  # torch and the engine load here

    await run_service(config)


__all__ = ["CONFIG", "PrefillConfig", "run"]
