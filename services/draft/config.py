"""DraftConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.services.draft.shape import MAX_SPECULATIVE_TOKENS, TreeShape
from kvmesh.shared.config.service_config import check_at_least, option
from kvmesh.shared.config.worker_config import EngineWorkerConfig


@dataclass(frozen=True, slots=True)
class DraftConfig(EngineWorkerConfig):
    """The engine worker's fields (model, device, KV pool, threads, metrics) and the drafter's.
    ``--model`` is the target model: its tokenizer is the one every draft must share, and
    ``early-exit`` drafts with its first ``--exit-layer`` layers."""

    worker_id: str | None = option(None, help="worker id (default: draft-<random>)")
    method: Literal["ngram", "early-exit", "model"] = option(
        "ngram",
        help="ngram: prompt lookup in the sequence's own tokens; early-exit: the target's first "
        "--exit-layer layers + its final norm and LM head; model: a small checkpoint "
        "(--draft-model) sharing the target's tokenizer",
    )
    num_speculative_tokens: int = option(4, help="draft tokens per proposal (tree depth)")
    tree: tuple[int, ...] = option(
        (),
        help="branching per depth, e.g. 2,2,1 (as many as --num-speculative-tokens): each node "
        "at depth d - 1 gets the W_d likeliest continuations (ngram: the most frequent; "
        "early-exit and model: the draft model's top W_d); absent: a chain",
    )
    lookahead: int | None = option(
        None,
        help="draft this many tokens beyond K, for the most likely outcome of the verify step "
        "(every draft accepted, then the drafter's own next tokens): the decode worker keeps a "
        "proposal while its sequence follows it, so one proposal serves the steps until the "
        "next arrives (0-17; default: 3 (K + 1), at most 17, for ngram, whose tokens are free; "
        "K + 1 for the models: one verify step ahead)",
    )
    ngram_max: int = option(4, help="ngram: longest suffix matched against the context")
    ngram_min: int = option(1, help="ngram: shortest suffix matched")
    exit_layer: int = option(1, help="early-exit: layers of the target the draft runs")
    draft_model: str | None = option(
        None, help="model: the draft checkpoint directory (or kvmesh-tiny)"
    )
    max_sequences: int = option(
        4096, help="sequences whose context a worker keeps (least recently used dropped first)"
    )
    max_batch: int = option(64, help="sequences drafted in one batch at most")
    idle_s: float = option(
        5.0,
        help="a context no update reached for this long is dropped (its end was lost in a NATS "
        "outage; a sequence only paused is sent again whole at its next step)",
    )

    def __post_init__(self) -> None:
        EngineWorkerConfig.__post_init__(self)
        self.shape  # noqa: B018 (validates K and the tree; raises ValueError)
        if not self.idle_s > 0:
            raise ValueError(f"--idle-s must be > 0 seconds, got {self.idle_s}")
        if self.lookahead is not None and not 0 <= self.lookahead <= MAX_SPECULATIVE_TOKENS + 1:
            raise ValueError(
                f"lookahead must be in [0, {MAX_SPECULATIVE_TOKENS + 1}], got {self.lookahead}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= min <= max <= 64, got "
                f"{self.ngram_min} and {self.ngram_max}"
            )
        if self.method == "early-exit" and self.exit_layer < 1:
            raise ValueError(f"exit_layer must be >= 1, got {self.exit_layer}")
        if self.method == "model" and not self.draft_model:
            raise ValueError("--method model needs --draft-model PATH (a small checkpoint)")
        check_at_least(self, 1, "max_sequences", "max_batch")

    @property
    def shape(self) -> TreeShape:
        """The tree K and --tree describe (validated: K, depths, node limit)."""
        return TreeShape.parse(self.num_speculative_tokens, self.tree)

    @property
    def num_lookahead_tokens(self) -> int:
        if self.lookahead is not None:
            return self.lookahead
        k = self.num_speculative_tokens
        if self.method == "ngram":
            return min(3 * (k + 1), MAX_SPECULATIVE_TOKENS + 1)
        return k + 1

    @property
    def pipeline_depth(self) -> int:
        """DraftCore's: the model drafters' chains are topped up while the sequence follows
        them (each of their tokens costs a forward pass); ngram's tokens are free and a tree
        branches at the sequence's end, so those are drafted anew (0)."""
        if self.method == "ngram" or not self.shape.is_chain:
            return 0
        return self.drafted_shape.depth

    @property
    def drafted_shape(self) -> TreeShape:
        """What is drafted: ``shape``, then ``lookahead`` more levels of one child each. A
        verify step adds at most K + 1 tokens, so each K + 1 of lookahead keeps a proposal
        useful one step longer (the decode worker's next step verifies the subtree below the
        tokens this one added)."""
        return TreeShape(self.shape.widths + (1,) * self.num_lookahead_tokens)

    @property
    def uses_data_plane(self) -> bool:
        """Early exit and model receive prompts' draft KV from prefill workers over
        ``transport`` (early exit: the first layers of the target's KV; model: the blocks of
        the same draft model run on the prefill worker); ngram moves nothing on the data
        plane."""
        return self.method in ("early-exit", "model")

    @property
    def role(self) -> str:
        return "draft"
