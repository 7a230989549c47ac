"""QueueKeeperConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see
kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.bus.prefill_job_stream import ACK_WAIT_S
from kvmesh.shared.config.service_config import check_positive, option
from kvmesh.shared.config.worker_config import MetricsServiceConfig


@dataclass(frozen=True, slots=True)
class QueueKeeperConfig(MetricsServiceConfig):
    worker_id: str | None = option(None, help="keeper id (default: prefill-queue-<random>)")
    heartbeat_s: float = option(
        1.0,
        help="seconds between checks that the queue is there, as kvmesh makes it, with its "
        "replicas",
    )
    ack_wait_s: float = option(
        ACK_WAIT_S,
        help="seconds a prefill worker has to announce a job it took before JetStream hands it "
        "to another worker",
    )

    def __post_init__(self) -> None:
        MetricsServiceConfig.__post_init__(self)
        check_positive(self, "ack_wait_s")
