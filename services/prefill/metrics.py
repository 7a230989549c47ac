"""Every metric a prefill worker exports on ``--metrics-port``, in one registry.

The engine loop reports each chunk's forward pass (``observe_chunk``), each KV write reports its
bytes and duration (``observe_write``), and each job its timeline when it ends
(``observe_job``). The router's ``kvmesh_router_prefill_*`` histograms hold the same job
timings mesh-wide; these say which prefill worker they came from.
"""

from __future__ import annotations

from kvmesh.services.prefill.plan import PrefillTiming
from kvmesh.shared.obs.metric_set import MetricSet, seconds_buckets

SECONDS_BUCKETS = seconds_buckets(0.001, 60.0)
# bytes per second: 10 MB/s (a loaded tcp link) to 100 GB/s (a fast RDMA NIC or shm)
BANDWIDTH_BUCKETS = (1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10, 1e11)


class PrefillMetrics(MetricSet):
    """A prefill worker's metrics, registered in ``self.registry`` (one per worker)."""

    def __init__(self) -> None:
        super().__init__("kvmesh_prefill")
        self.queue_wait = self.histogram(
            "queue_wait_seconds",
            "Time a job waited in the prefill queue before this worker took it.",
            SECONDS_BUCKETS,
        )
        self.chunk_compute = self.histogram(
            "chunk_compute_seconds",
            "Forward pass of one prefill chunk (one engine step, shared by the jobs in flight).",
            SECONDS_BUCKETS,
        )
        self.kv_bytes_written = self.counter(
            "kv_bytes_written_total", "KV cache bytes written into decode workers' blocks."
        )
        self.draft_kv_bytes = self.counter(
            "draft_kv_bytes_written_total",
            "Draft KV bytes written into draft workers' blocks (early exit: the first layers of "
            "each prompt block; model: the draft model's whole blocks).",
        )
        self.draft_compute = self.histogram(
            "draft_compute_seconds",
            "With --draft-model: one step of the draft model's engine over the prompts' chunks "
            "(after each target step; what a job pays for its draft KV).",
            SECONDS_BUCKETS,
        )
        self.kv_write = self.histogram(
            "kv_write_seconds",
            "Duration of one chunk's KV write (issue to completion).",
            SECONDS_BUCKETS,
        )
        self.kv_write_bandwidth = self.histogram(
            "kv_write_bandwidth_bytes_per_second",
            "Bandwidth of one chunk's KV write: its bytes over its duration.",
            BANDWIDTH_BUCKETS,
        )
        self.exposed_transfer = self.histogram(
            "kv_exposed_transfer_seconds",
            "Per job: KV transfer time not hidden behind compute (end of the last forward pass "
            "to the last write landing).",
            SECONDS_BUCKETS,
        )
        self.jobs = self.counter(
            "jobs_total",
            "Prefill jobs that ended, by outcome (ok: every chunk written and announced; "
            "failed: refused, aborted or a write failed).",
            ("outcome",),
        )
        self.borrowed_steps = self.counter(
            "borrowed_steps_total",
            "Engine steps computed on decode's cores too, while every decode worker was idle "
            "(--borrow-cpus).",
        )
        self.jobs_running = self.gauge("jobs_running", "Jobs this worker holds now.")
        self.prompt_tokens = self.counter(
            "prompt_tokens_total", "Prompt tokens of the jobs this worker took."
        )
        self.prefix_hit_tokens = self.counter(
            "prefix_hit_tokens_total",
            "Prompt tokens the engine took from its prefix cache instead of computing them "
            "(counted as it allocates; includes blocks read from a kv-store).",
        )
        self.store_hit_tokens = self.counter(
            "store_hit_tokens_total",
            "Prompt tokens read one-sided from a kv-store into the prefix cache before a job.",
        )

    def observe_chunk(self, seconds: float) -> None:
        self.chunk_compute.observe(seconds)

    def observe_write(self, num_bytes: int, seconds: float) -> None:
        self.kv_bytes_written.inc(num_bytes)
        self.kv_write.observe(seconds)
        if seconds > 0:
            self.kv_write_bandwidth.observe(num_bytes / seconds)

    def observe_job(self, timing: PrefillTiming | None, ok: bool) -> None:
        """A job ended; ``timing`` is None for a job refused before it started computing."""
        self.jobs.labels("ok" if ok else "failed").inc()
        if timing is not None:
            self.queue_wait.observe(timing.queue_s)
            if ok:
                self.exposed_transfer.observe(timing.exposed_transfer_s)
