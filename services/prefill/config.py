"""PrefillConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.services.prefill.core_loan import CoreLoan
from kvmesh.shared.config.cpu_placement import parse_cpu_list
from kvmesh.shared.config.service_config import check_positive, option
from kvmesh.shared.config.worker_config import EngineWorkerConfig

if TYPE_CHECKING:
    from kvmesh.shared.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class PrefillConfig(EngineWorkerConfig):
    """The engine worker's fields (kvmesh.shared.config.worker_config) and prefill's own."""

    worker_id: str | None = option(None, help="worker id (default: prefill-<random>)")
    chunk_tokens: int = option(
        512,
        help="prefill tokens per forward pass (shared by the jobs in flight); each chunk's "
        "blocks are written to the decode worker while the next chunk computes",
    )
    max_concurrent_jobs: int = option(
        1,
        help="prefill jobs this worker holds at once (pulled from the queue only when a slot is "
        "free; few slots keep jobs first-come-first-served and leave the rest to idle peers)",
    )
    abort_memory_s: float = option(
        660.0,
        help="how long an Abort is remembered for jobs not yet taken (longer than a job may wait "
        "in the queue, 600 s, so an aborted job is never computed)",
    )

    draft_kv: bool = option(
        False,
        help="speculative meshes with early-exit (or, with --draft-model, model) draft workers: "
        "ask one to reserve blocks for each prompt's draft KV and write it every full prompt "
        "block's draft KV beside the decode worker's writes (early exit: the first layers of "
        "this worker's blocks), so the draft worker never computes the prompt "
        "(docs/speculative.md); without an answer the job goes on without",
    )
    draft_model: str | None = option(
        None,
        help="with --draft-kv: the draft checkpoint of the mesh's model draft workers (the same "
        "as their --draft-model); this worker runs it over every prompt beside the target, in "
        "an engine and KV pool of its own, and writes its whole blocks to them",
    )
    draft_kv_cache_bytes: int = option(
        64 << 20,
        help="with --draft-model: the draft engine's KV pool in bytes (holds the prompts of "
        "the jobs in flight; a prompt that finds no room gets no draft KV)",
    )
    borrow_cpus: str | None = option(
        None,
        help="CPUs (e.g. 1 or 2-3) this worker also computes a step on while every decode worker "
        "it hears is idle: decode's own cores, with --cpus (kvmesh up sets it with --cpu-sharing "
        "partition and one prefill worker; docs/load.md, Cores)",
    )
    grammar_compile_timeout_s: float = option(
        10.0,
        help="a structured output's grammar (its first token follows it) must compile within "
        "this many seconds, in a thread, while other jobs go on; past it the job fails and its "
        "spec is refused at once when sent again",
    )
    tp: int = option(
        1,
        help="tensor parallelism: this worker runs as N rank processes (this one and N-1 it "
        "starts), each holding 1/N of the model's heads and MLP, that appear as one worker; "
        "each rank writes its own heads of every chunk to the decode worker (docs/tp.md). "
        "Runs without --draft-kv, a KV dtype other than the decode's, or the kv-store",
    )
    use_kv_store: bool = option(
        True,
        help="read prompt prefixes from a kv-store advertising on the mesh into the prefix cache "
        "before computing, and put computed prompt blocks into it after (docs/kv_store.md)",
    )

    def __post_init__(self) -> None:
        EngineWorkerConfig.__post_init__(self)
        if self.chunk_tokens < self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must hold at least one block ({self.block_size} tokens)"
            )
        check_positive(
            self,
            "max_concurrent_jobs",
            "draft_kv_cache_bytes",
            "abort_memory_s",
            "grammar_compile_timeout_s",
            "tp",
        )
        if self.tp > 1 and self.draft_kv:
            raise ValueError("--tp > 1 runs without --draft-kv (the draft KV hook is one rank's)")
        if self.draft_model and not self.draft_kv:
            raise ValueError("--draft-model needs --draft-kv (it only serves the draft KV)")
        if self.borrow_cpus is not None:
            self.core_loan(self.cpu_placement().cpus)  # ValueError: what to fix, in one line

    def core_loan(self, own: frozenset[int]) -> CoreLoan | None:
        """The decode cores this worker may borrow (None without --borrow-cpus); ``own``: the
        CPUs it runs on."""
        if self.borrow_cpus is None:
            return None
        return CoreLoan(own, parse_cpu_list(self.borrow_cpus), self.threads or len(own))

    def engine_config(
        self, dtype: Any, kv_cache_bytes: int | None, num_blocks: int | None = None
    ) -> EngineConfig:
        """An engine for this worker's jobs: its chunk budget and job slots (the target's, and
        the draft model's, so a prompt's draft chunks follow its target chunks step by step)."""
        from kvmesh.shared.engine.config import worker_engine_config

        return worker_engine_config(
            self,
            dtype,
            kv_cache_bytes=kv_cache_bytes,
            num_blocks=num_blocks,
            max_num_seqs=self.max_concurrent_jobs,
            max_num_batched_tokens=self.chunk_tokens,
        )
