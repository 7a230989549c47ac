"""Decode service: reserves KV blocks for remote prefills, admits prefilled sequences into
continuous batching, streams tokens; ``mode=colocated`` prefills locally (the baseline)."""

from kvmesh.services.decode.config import DecodeConfig

CONFIG = DecodeConfig


async def run(config: DecodeConfig) -> None:
    from kvmesh.services.decode.serve import run as run_service  # torch and the engine load here

    await run_service(config)


__all__ = ["CONFIG", "DecodeConfig", "run"]
