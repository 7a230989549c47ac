"""DecodeConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.bus.messages.cache_events import MAX_CACHE_EVENT_HASHES
from kvmesh.shared.config.service_config import check_at_least, check_positive, option
from kvmesh.shared.config.worker_config import EngineWorkerConfig
from kvmesh.shared.kv.imm import MAX_SLOTS


@dataclass(frozen=True, slots=True)
class DecodeConfig(EngineWorkerConfig):
    """The engine worker's fields (kvmesh.shared.config.worker_config) and decode's own."""

    worker_id: str | None = option(None, help="worker id (default: decode-<random>)")
    heartbeat_s: float = option(1.0, help="seconds between heartbeats and adverts")
    mode: Literal["disagg", "colocated"] = option(
        "disagg",
        help="disagg: prompts are prefilled remotely unless asked otherwise; "
        "colocated: every prompt is prefilled here (the baseline)",
    )
    max_num_seqs: int = option(64, help="sequences decoded in one batch at most")
    max_num_batched_tokens: int = option(
        512,
        help="tokens per step: decodes first, then local prefill chunks fill the rest (a larger "
        "budget prefills faster but stalls every decoding stream for longer)",
    )
    max_num_batched_tokens_no_decode: int = option(
        4096,
        help="tokens of a step in which nothing decodes (so no stream stalls): the oldest local "
        "prompt prefills up to this many at once (0: --max-num-batched-tokens always)",
    )
    reserve_output_tokens: int = option(
        512,
        help="admission keeps room for this many output tokens per request (at most its "
        "max_tokens), so decodes do not preempt under load; 0: admit while the prompt fits",
    )
    min_step_interval_ms: float = option(
        0.0,
        help="start engine steps at most this often (0: back to back); set it near the "
        "inter-token latency target to leave the rest of a shared core to prefill",
    )
    max_lease_s: float = option(
        120.0, help="longest lease a reservation or renewal may ask for (longer ones are capped)"
    )
    lease_check_s: float = option(0.1, help="seconds between lease-expiry checks")
    quarantine_s: float = option(
        30.0,
        help="after a lease expires, seconds its blocks stay out of the pool unless the prefill "
        "confirms it stopped writing",
    )
    cache_events_interval_s: float = option(
        0.1,
        help="seconds between reports of the prefix cache's changes to the kv-registry "
        "(KvCacheEvents; none are sent while nothing changes)",
    )
    cache_digest_interval_s: float = option(
        5.0,
        help="seconds between full reports of the prefix cache (KvCacheDigest): a registry that "
        "restarted or missed events is in sync again after at most this long",
    )
    max_cache_events: int = option(
        4096,
        help="prefix cache changes kept between two reports; past it a full report replaces them",
    )
    grammar_compile_timeout_s: float = option(
        10.0,
        help="a structured output's grammar must compile within this many seconds (in a "
        "thread, off the event loop); past it the request fails and its spec is refused at once "
        "when sent again",
    )
    resume_max_tokens: int = option(
        4096,
        help="tokens of each stream kept so that a client whose router died can resume it "
        "through another (Last-Event-ID; docs/faults.md); a longer stream cannot be resumed",
    )
    resume_grace_s: float = option(
        10.0, help="seconds a stream's tokens are kept for a resume after the stream ended"
    )
    resume_window_s: float | None = option(
        None,
        help="when the registry announces a router gone, its streaming sequences decode on "
        "this many seconds for a client to resume them through another router, then are "
        "aborted (default: one heartbeat_s; 0: at once; docs/faults.md)",
    )

    speculative: bool = option(
        False,
        help="speculative decoding: send each sequence's context to the draft service "
        "(kvmesh serve draft) and verify its proposals in the next steps; never waits for them",
    )
    tp: int = option(
        1,
        help="tensor parallelism: this worker runs as N rank processes (this one and N-1 it "
        "starts), each holding 1/N of the model's heads and MLP and its KV heads in a pool of "
        "its own, that appear as one worker (one advert, one lease a request); prefill workers "
        "write each rank its heads (docs/tp.md). Runs without --speculative and the kv-store",
    )
    use_kv_store: bool = option(
        True,
        help="put the KV blocks of finished requests (prompt and output) into a kv-store "
        "advertising on the mesh, in the background, for later turns, and swap preempted "
        "sequences out to it and back instead of recomputing them (docs/kv_store.md)",
    )

    def __post_init__(self) -> None:
        EngineWorkerConfig.__post_init__(self)
        check_positive(
            self,
            "max_num_seqs",
            "max_num_batched_tokens",
            "lease_check_s",
            "max_lease_s",
            "cache_events_interval_s",
            "cache_digest_interval_s",
            "grammar_compile_timeout_s",
            "resume_max_tokens",
        )
        check_at_least(
            self,
            0,
            "quarantine_s",
            "reserve_output_tokens",
            "min_step_interval_ms",
            "max_num_batched_tokens_no_decode",
            "resume_grace_s",
        )
        check_positive(self, "tp")
        if self.tp > 1 and self.speculative:
            raise ValueError(
                f"--tp {self.tp} needs no --speculative (a speculative decode worker runs at "
                "TP1; docs/tp.md)"
            )
        if self.resume_window_s is not None and self.resume_window_s < 0:
            raise ValueError(f"resume_window_s must be >= 0, got {self.resume_window_s}")
        if self.num_blocks is not None and self.num_blocks > MAX_SLOTS:
            raise ValueError(
                f"num_blocks must be in [1, {MAX_SLOTS}] (immediates name a request by "
                f"its first block), got {self.num_blocks}"
            )
        if not 0 < self.max_cache_events <= MAX_CACHE_EVENT_HASHES:
            raise ValueError(
                f"max_cache_events must be in [1, {MAX_CACHE_EVENT_HASHES}], "
                f"got {self.max_cache_events}"
            )

    @property
    def uses_data_plane(self) -> bool:
        return self.mode == "disagg"  # colocated workers take no remote writes

    @property
    def role(self) -> str:
        return "colocated" if self.mode == "colocated" else "decode"
