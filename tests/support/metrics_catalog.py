"""Every metric every kvmesh service registers, read from the services' metrics modules (no
running service needed): for the metrics table of docs/metrics.md and the Grafana dashboard check.

``python tests/support/metrics_catalog.py`` prints the table of docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

# what each family type exposes as series, by suffix
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


@dataclass(frozen=True, slots=True)
class MetricDoc:
    service: str
    name: str  # as queried: counters with _total, histograms without a suffix
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        base = self.name.removesuffix("_total") if self.type == "counter" else self.name
        return tuple(base + suffix for suffix in SUFFIXES[self.type])


def service_metrics() -> dict[str, object]:
    """One fresh metrics object per service, as each service builds it."""
    from kvmesh.services.decode.metrics import DecodeMetrics
    from kvmesh.services.draft.metrics import DraftMetrics
    from kvmesh.services.kv_registry.core import RegistryState
    from kvmesh.services.kv_registry.metrics import RegistryMetrics
    from kvmesh.services.kv_store.core import BlockStore
    from kvmesh.services.kv_store.metrics import StoreMetrics
    from kvmesh.services.prefill.metrics import PrefillMetrics
    from kvmesh.services.prefill_queue.metrics import QueueKeeperMetrics
    from kvmesh.services.router.metrics import RouterMetrics
    from kvmesh.shared.transport.base import TransportStats

    return {
        "router": RouterMetrics(),
        "kv-registry": RegistryMetrics(RegistryState(worker_timeout_s=3.0)),
        "prefill": PrefillMetrics(),
        "decode": DecodeMetrics(),
        "draft": DraftMetrics(),
        "kv-store": StoreMetrics(BlockStore(1), TransportStats, 1),
        "prefill-queue": QueueKeeperMetrics(),
    }


def _declared_labels(metrics: object) -> dict[str, tuple[str, ...]]:
    """Label names of the prometheus_client metrics a metrics object holds (a labelled metric
    with no child yet has no sample to read them from)."""
    found: dict[str, tuple[str, ...]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            found[value._name] = tuple(value._labelnames)
        elif hasattr(value, "declared_labels"):  # a custom collector that says
            found.update(value.declared_labels())
    return found


def catalog() -> list[MetricDoc]:
    docs: list[MetricDoc] = []
    for service, metrics in service_metrics().items():
        registry: CollectorRegistry = metrics.registry  # type: ignore[attr-defined]
        declared = _declared_labels(metrics)
        for family in registry.collect():
            labels = declared.get(family.name)
            if labels is None:
                names = {k for s in family.samples for k in s.labels if k != "le"}
                labels = tuple(sorted(names))
            name = family.name + "_total" if family.type == "counter" else family.name
            docs.append(MetricDoc(service, name, family.type, labels, family.documentation))
    return docs


def series_names() -> set[str]:
    """Every series name a PromQL expression may use."""
    return {s for doc in catalog() for s in doc.series}


def markdown_table() -> str:
    lines = ["| service | metric | type | labels | meaning |", "|---|---|---|---|---|"]
    for doc in catalog():
        labels = ", ".join(f"`{label}`" for label in doc.labels)
        lines.append(f"| {doc.service} | `{doc.name}` | {doc.type} | {labels} | {doc.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
