"""The kv-store's metrics on ``--metrics-port``: read from its core and its transport when
Prometheus scrapes, so they are exact without a call wherever the core changes them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvmesh.services.kv_store.core import BlockStore
from kvmesh.shared.metric_set import MetricSet
from kvmesh.shared.transport.base import TransportStats
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# counter name -> (BlockStore.counters field, help)
COUNTERS = {
    "hits": ("hits", "Blocks served by gets (each a prefill block a reader need not compute)."),
    "misses": ("misses", "Blocks asked for by gets and not served (not stored, or after a gap)."),
    "evictions": ("evictions", "Unpinned blocks evicted (least recently used) to make room."),
    "commits": ("commits", "Blocks indexed after a commit checked their header and bytes."),
    "rejected_blocks": ("rejected", "Blocks a commit refused: header or CRC32 did not match."),
    "refused_puts": ("refused_puts", "Puts refused because every slot was pinned."),
    "expired_puts": ("expired_puts", "Puts whose lease ended before their commit."),
    "expired_gets": ("expired_gets", "Gets whose lease ended before their release."),
}


class StoreCollector(Collector):
    def __init__(self, store: BlockStore, stats: Callable[[], TransportStats], block_bytes: int):
        self.store = store
        self.stats = stats
        self.block_bytes = block_bytes

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = self.store.counters
        for name, (field, help_text) in COUNTERS.items():
            yield CounterMetricFamily(f"kvmesh_store_{name}", help_text, getattr(counters, field))
        stats = self.stats()
        yield CounterMetricFamily(
            "kvmesh_store_bytes_written",
            "Bytes writers placed in the store (one-sided writes, headers included).",
            stats.bytes,
        )
        yield CounterMetricFamily(
            "kvmesh_store_bytes_read",
            "Bytes readers pulled from the store (one-sided reads; rdma reads are the NIC's and "
            "not counted here).",
            stats.read_bytes,
        )
        yield CounterMetricFamily(
            "kvmesh_store_refused_accesses",
            "One-sided writes and reads the transport refused (outside a window, closed, ...).",
            stats.refused,
        )
        for name, value, help_text in (
            ("capacity_blocks", self.store.num_blocks, "Blocks the pool holds."),
            ("used_blocks", self.store.num_used, "Blocks stored (indexed)."),
            ("pinned_blocks", self.store.num_pinned, "Blocks held by puts and gets in flight."),
            ("block_bytes", self.block_bytes, "Bytes per block (the mesh's KV block)."),
        ):
            yield GaugeMetricFamily(f"kvmesh_store_{name}", help_text, value)


class StoreMetrics(MetricSet):
    def __init__(self, store: BlockStore, stats: Callable[[], TransportStats], block_bytes: int):
        super().__init__("kvmesh_store")
        self.registry.register(StoreCollector(store, stats, block_bytes))
