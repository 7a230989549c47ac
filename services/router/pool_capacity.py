"""How much context a request can really use: the largest KV pool among the decode workers that
serve the router's model, from their adverts (pure; the clock is passed in).

A decode worker's engine ends a sequence ("length") before it outgrows its whole pool, and the
registry refuses a prompt larger than every pool; so the usable context is the model's
``max_model_len`` or the largest pool, whichever is smaller. ``/v1/models`` reports it, and
``prompt.tokenize`` refuses what exceeds it with a 400 that names the setting to raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.shared.bus.messages.workers import DecodeAdvert

# an advert older than this no longer counts (a worker advertises every heartbeat)
ADVERT_TTL_S = 30.0


@dataclass(slots=True)
class PoolCapacity:
    model_spec: str  # only workers advertising this model count ("" counts every worker)
    model_len: int = 0  # the model's context (--max-model-len or the checkpoint's); 0: unknown
    _tokens: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (tokens, when)

    def note(self, advert: DecodeAdvert, now: float) -> None:
        if self.model_spec and advert.reach.model_spec != self.model_spec:
            return
        self._tokens[advert.worker_id] = (advert.pool.total_blocks * advert.reach.block_size, now)

    def forget(self, worker_id: str) -> None:
        self._tokens.pop(worker_id, None)

    def max_tokens(self, now: float) -> int | None:
        """Tokens the largest live pool holds (None until a worker has advertised)."""
        live = [tokens for tokens, when in self._tokens.values() if now - when <= ADVERT_TTL_S]
        return max(live, default=None)

    def context(self, now: float) -> int:
        """The context a request can use: ``model_len``, or the largest live pool when that is
        smaller. The one ``max_model_len``: /v1/models, /tokenize and the router's log say it."""
        pool = self.max_tokens(now)
        return self.model_len if pool is None else min(self.model_len or pool, pool)
