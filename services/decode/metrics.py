"""Every metric a decode (or colocated) worker exports on ``--metrics-port``, in one registry.

The engine loop reports each step (``observe_step``); the load gauges follow the stats every
advert carries (``observe_load``), so they are at most one heartbeat old. The refusal counters
of the transport are in the adverts too; the router exports those per worker
(``kvmesh_decode_refused_accesses_total`` and friends, services/router/metrics.py).
"""

from __future__ import annotations

from kvmesh.shared.bus.messages.workers import BlockPool, WorkerLoad
from kvmesh.shared.obs.metric_set import MetricSet, seconds_buckets

STEP_BUCKETS = seconds_buckets(0.001, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecodeMetrics(MetricSet):
    """A decode worker's metrics, registered in ``self.registry`` (one per worker)."""

    def __init__(self) -> None:
        super().__init__("kvmesh_decode")
        self.running = self.gauge("requests_running", "Sequences in the running batch.")
        self.waiting = self.gauge(
            "requests_waiting",
            "Requests accepted but not yet running: queued for the batch, or reserved and "
            "waiting for their remote prefill.",
        )
        self.kv_blocks_used = self.gauge(
            "kv_blocks_used", "KV blocks in use (running sequences, reservations, quarantine)."
        )
        self.kv_blocks_total = self.gauge("kv_blocks_capacity", "KV blocks in the worker's pool.")
        self.step_seconds = self.histogram(
            "step_seconds",
            "Duration of one engine step (schedule, forward pass, sampling).",
            STEP_BUCKETS,
        )
        self.batch_size = self.histogram(
            "batch_size", "Sequences that got a new token in one engine step.", BATCH_BUCKETS
        )
        self.preemptions = self.counter(
            "preemptions_total",
            "Running sequences preempted for lack of KV blocks (swapped out to a kv-store, or "
            "recomputed later).",
        )
        self.generated_tokens = self.counter("generated_tokens_total", "Output tokens sampled.")
        self.spec_draft_tokens = self.counter(
            "spec_draft_tokens_total",
            "Draft positions verified (the depth of each verified draft tree: the most that "
            "could have been accepted).",
        )
        self.spec_draft_nodes = self.counter(
            "spec_draft_nodes_total",
            "Draft tree nodes verified (more than the positions when trees branch: the "
            "siblings are verified too).",
        )
        self.spec_accepted_tokens = self.counter(
            "spec_accepted_tokens_total", "Draft tokens accepted by verification."
        )
        self.spec_acceptance_rate = self.gauge(
            "spec_acceptance_rate",
            "Accepted over verified draft positions since the worker started.",
        )
        self.spec_tokens_per_step = self.histogram(
            "spec_tokens_per_step",
            "Tokens a sequence got from one verify step (accepted drafts + the next token).",
            (1, 2, 3, 4, 5, 6, 8, 10, 12, 17),
        )
        self.spec_verify_step_seconds = self.histogram(
            "spec_verify_step_seconds",
            "Duration of an engine step that verified draft trees.",
            STEP_BUCKETS,
        )
        self.spec_draft_latency_seconds = self.histogram(
            "spec_draft_latency_seconds",
            "From sending a sequence's context to the draft service to its proposal arriving.",
            STEP_BUCKETS,
        )
        self.prefix_hit_tokens = self.counter(
            "prefix_cache_hit_tokens_total",
            "Prompt tokens of locally prefilled (and recomputed) sequences taken from the "
            "prefix cache instead of being computed.",
        )
        self.prefix_cached_blocks = self.gauge(
            "prefix_cached_blocks",
            "Blocks in the prefix cache (full, hashed, reusable; in use or free).",
        )
        self.local_prompt_tokens = self.counter(
            "local_prompt_tokens_total",
            "Prompt tokens of requests this worker prefilled itself (local prefills, colocated); "
            "less prefix_cache_hit_tokens: the tokens it computed.",
        )
        self.store_hit_tokens = self.counter(
            "store_hit_tokens_total",
            "Prompt tokens of local prefills read one-sided from a kv-store into the prefix cache "
            "instead of being computed (also counted in prefix_cache_hit_tokens).",
        )
        self.swap_outs = self.counter(
            "swap_outs_total",
            "Preempted sequences whose full blocks were put into a kv-store (at least the first "
            "one stored) instead of only being freed.",
        )
        self.swap_out_failures = self.counter(
            "swap_out_failures_total",
            "Preempted sequences whose put into a kv-store failed, was refused or stored nothing "
            "(their blocks are recomputed when the pool lost them).",
        )
        self.swap_ins = self.counter(
            "swap_ins_total", "Swapped-out sequences readmitted (their swap-in decided)."
        )
        self.swap_in_tokens = self.counter(
            "swap_in_tokens_total",
            "Tokens of swapped-out blocks on readmission, by where their KV came from: cached "
            "(still in the pool), read (from the kv-store), recomputed.",
            ("source",),
        )
        self._num_hit_tokens = 0
        self._num_preemptions = 0  # the engine's running total at the last step
        self._spec_positions = 0
        self._spec_accepted = 0

    def observe_step(
        self, seconds: float, batch_size: int, num_tokens: int, num_preemptions: int
    ) -> None:
        """One engine step took ``seconds`` and gave ``num_tokens`` to ``batch_size`` sequences;
        ``num_preemptions`` is the scheduler's running total."""
        self.step_seconds.observe(seconds)
        if batch_size:
            self.batch_size.observe(batch_size)
        self.generated_tokens.inc(num_tokens)
        if num_preemptions > self._num_preemptions:
            self.preemptions.inc(num_preemptions - self._num_preemptions)
        self._num_preemptions = num_preemptions

    def observe_verify(
        self,
        seconds: float,
        num_positions: int,
        num_accepted: int,
        tokens_per_seq: list[int],
        num_nodes: int = 0,
    ) -> None:
        """A step verified draft trees of ``num_positions`` total depth and ``num_nodes``
        nodes; ``num_accepted`` kept; ``tokens_per_seq``: tokens each verified sequence got."""
        self.spec_verify_step_seconds.observe(seconds)
        self.spec_draft_tokens.inc(num_positions)
        self.spec_draft_nodes.inc(num_nodes)
        self.spec_accepted_tokens.inc(num_accepted)
        for n in tokens_per_seq:
            self.spec_tokens_per_step.observe(n)
        self._spec_positions += num_positions
        self._spec_accepted += num_accepted
        if self._spec_positions:
            self.spec_acceptance_rate.set(self._spec_accepted / self._spec_positions)

    def observe_prefix_cache(self, num_hit_tokens: int, num_cached_blocks: int) -> None:
        """After a step: the block manager's running total of prompt tokens it reused, and the
        blocks its prefix cache holds."""
        self.prefix_cached_blocks.set(num_cached_blocks)
        if num_hit_tokens > self._num_hit_tokens:
            self.prefix_hit_tokens.inc(num_hit_tokens - self._num_hit_tokens)
        self._num_hit_tokens = num_hit_tokens

    def observe_swap_in(self, num_cached: int, num_read: int, num_recomputed: int) -> None:
        """A swapped-out sequence was readmitted: where its swapped blocks' tokens came from."""
        self.swap_ins.inc()
        self.swap_in_tokens.labels("cached").inc(num_cached)
        self.swap_in_tokens.labels("read").inc(num_read)
        self.swap_in_tokens.labels("recomputed").inc(num_recomputed)

    def observe_load(self, load: WorkerLoad, pool: BlockPool) -> None:
        """The worker's load and pool (``DecodeWorker.load()``: what its advert reports)."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_blocks_total.set(pool.total_blocks)
        self.kv_blocks_used.set(pool.total_blocks - pool.free_blocks)
