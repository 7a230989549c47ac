"""Draft service: proposes draft tokens (n-gram lookup, early exit, or a small model) for the
sequences decode workers run; they verify them in their next step (speculative decoding)."""

from kvmesh.services.draft.config import DraftConfig

CONFIG = DraftConfig


async def run(config: DraftConfig) -> None:
    from kvmesh.services.draft.service import run as run_service  # torch loads here

    await run_service(config)


__all__ = ["CONFIG", "DraftConfig", "run"]
