"""Every metric a prefill worker exports on ``--metrics-port``, in one registry.

The engine loop reports each chunk's forward pass (``observe_chunk``), each KV write reports its
bytes and duration (``observe_write``), and each job its timeline when it ends
(``observe_job``). The router's ``kvmesh_router_prefill_*`` histograms hold the same job
timings mesh-wide; these say which prefill worker they came from.
"""

from __future__ import annotations

from kvmesh.services.prefill.plan import PrefillTiming
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# bytes per second: 10 MB/s (a loaded tcp link) to 100 GB/s (a fast RDMA NIC or shm)
BANDWIDTH_BUCKETS = (1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10, 1e11)


class PrefillMetrics:
    """A prefill worker's metrics, registered in ``self.registry`` (one per worker)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_wait = Histogram(
            "kvmesh_prefill_queue_wait_seconds",
            "Time a job waited in the prefill queue before this worker took it.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.chunk_compute = Histogram(
            "kvmesh_prefill_chunk_compute_seconds",
            "Forward pass of one prefill chunk (one engine step, shared by the jobs in flight).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.kv_bytes_written = Counter(
            "kvmesh_prefill_kv_bytes_written_total",
            "KV cache bytes written into decode workers' blocks.",
            registry=r,
        )
        self.kv_write = Histogram(
            "kvmesh_prefill_kv_write_seconds",
            "Duration of one chunk's KV write (issue to completion).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.kv_write_bandwidth = Histogram(
            "kvmesh_prefill_kv_write_bandwidth_bytes_per_second",
            "Bandwidth of one chunk's KV write: its bytes over its duration.",
            buckets=BANDWIDTH_BUCKETS,
            registry=r,
        )
        self.exposed_transfer = Histogram(
            "kvmesh_prefill_kv_exposed_transfer_seconds",
            "Per job: KV transfer time not hidden behind compute (end of the last forward pass "
            "to the last write landing).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.jobs = Counter(
            "kvmesh_prefill_jobs_total",
            "Prefill jobs that ended, by outcome (ok: every chunk written and announced; "
            "failed: refused, aborted or a write failed).",
            ("outcome",),
            registry=r,
        )
        self.jobs_running = Gauge(
            "kvmesh_prefill_jobs_running", "Jobs this worker holds now.", registry=r
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
