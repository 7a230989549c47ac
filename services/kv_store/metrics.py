"""The kv-store's metrics on ``--metrics-port``: read from its core and its transport when
Prometheus scrapes, so they are exact without a call wherever the core changes them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvmesh.services.kv_store.core import BlockStore
from kvmesh.shared.obs.metric_set import MetricSet
from kvmesh.shared.transport.base import TransportStats
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# counter name -> (BlockStore.counters field, help)
COUNTERS = {
    "hits": (
        "hits",
        "Blocks served by gets, either tier (each a prefill block a reader need not compute).",
    ),
    "misses": ("misses", "Blocks asked for by gets and not served (not stored, or after a gap)."),
    "evictions": (
        "evictions",
        "Unpinned blocks evicted from host memory (least recently used) to make room: spilled "
        "to the disk tier if there is one, else dropped.",
    ),
    "commits": ("commits", "Blocks indexed after a commit checked their header and bytes."),
    "rejected_blocks": ("rejected", "Blocks a commit refused: header or CRC32 did not match."),
    "refused_puts": ("refused_puts", "Puts refused because every slot was pinned."),
    "expired_puts": ("expired_puts", "Puts whose lease ended before their commit."),
    "expired_gets": ("expired_gets", "Gets whose lease ended before their release."),
    "spills": ("spills", "Blocks evicted from host memory and copied to the disk tier."),
    "promotions": ("promotions", "Disk-tier blocks a get hit, copied back to host memory."),
    "failed_copies": (
        "failed_copies",
        "Spills and promotions whose file I/O failed (the block is dropped, the store goes on).",
    ),
}


class StoreCollector(Collector):
    def __init__(self, store: BlockStore, stats: Callable[[], TransportStats], block_bytes: int):
        self.store = store
        self.stats = stats
        self.block_bytes = block_bytes

    def declared_labels(self) -> dict[str, tuple[str, ...]]:
        """For the metrics catalog (tests/support/metrics_catalog.py)."""
        tiers = {
            f"kvmesh_store_tier_{n}": ("tier",)
            for n in ("hits", "evictions", "capacity_bytes", "used_bytes")
        }
        return {**tiers, "kvmesh_store_evictions_by_reason": ("reason",)}

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
        yield from self._tiers()
        yield self._evictions_by_reason()

    def _evictions_by_reason(self) -> CounterMetricFamily:
        c, disk = self.store.counters, self.store.disk
        family = CounterMetricFamily(
            "kvmesh_store_evictions_by_reason",
            "Blocks that left a tier other than by a get, by reason: host_room (the host "
            "tier's least recently used, for a put or a promotion; spilled or dropped), "
            "disk_room (the disk tier's least recently used, dropped for a spill), quota (a "
            "writer's own least recently used, disk first, for its put past its quota), "
            "writer_gone (the kv-registry dropped the writer), failed_copy (a spill or "
            "promotion whose I/O failed).",
            labels=["reason"],
        )
        for reason, value in (
            ("host_room", c.evictions),
            ("disk_room", disk.num_evictions if disk is not None else 0),
            ("quota", c.quota_evictions),
            ("writer_gone", c.owner_drops),
            ("failed_copy", c.failed_copies),
        ):
            family.add_metric([reason], value)
        return family

    def _tiers(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per tier (``host``, and ``disk`` when the store has one)."""
        c, disk, bb = self.store.counters, self.store.disk, self.block_bytes
        hits = CounterMetricFamily(
            "kvmesh_store_tier_hits",
            "Blocks served by gets, by the tier they were found in (disk: promoted first).",
            labels=["tier"],
        )
        evictions = CounterMetricFamily(
            "kvmesh_store_tier_evictions",
            "Blocks evicted from a tier to make room (host: spilled or dropped; disk: dropped).",
            labels=["tier"],
        )
        capacity = GaugeMetricFamily(
            "kvmesh_store_tier_capacity_bytes", "Bytes of blocks a tier holds.", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "kvmesh_store_tier_used_bytes", "Bytes of blocks stored in a tier.", labels=["tier"]
        )
        hits.add_metric(["host"], c.hits - c.disk_hits)
        evictions.add_metric(["host"], c.evictions)
        capacity.add_metric(["host"], self.store.num_blocks * bb)
        used.add_metric(["host"], self.store.num_used * bb)
        if disk is not None:
            hits.add_metric(["disk"], c.disk_hits)
            evictions.add_metric(["disk"], disk.num_evictions)
            capacity.add_metric(["disk"], disk.num_slots * bb)
            used.add_metric(["disk"], disk.num_used * bb)
        yield from (hits, evictions, capacity, used)


class StoreMetrics(MetricSet):
    def __init__(self, store: BlockStore, stats: Callable[[], TransportStats], block_bytes: int):
        super().__init__("kvmesh_store")
        self.collector = StoreCollector(store, stats, block_bytes)
        self.registry.register(self.collector)
