"""A decode worker started: model, KV pool over transport memory, NATS, its features
(compose.py), the worker and the service shell (service.py) with their subscriptions and loops,
ready to serve; ``run`` serves until a signal, then drains."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import torch
from kvmesh.services.decode.compose import DecodeParts, build_engine, compose_features
from kvmesh.services.decode.config import DecodeConfig
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.service import DecodeService
from kvmesh.services.decode.tp_group import DecodeRanks, lease_windows, tp_config, with_ranks
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.messages.placement import LeaseCancel, LeaseRenew
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import Abort
from kvmesh.shared.bus.messages.workers import DecodeReach, WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.service_lifetime import background, serve_until_signal
from kvmesh.shared.bus.worker_feature import Site
from kvmesh.shared.bus.worker_presence import heartbeat_loop, new_worker_id
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.identity import model_spec
from kvmesh.shared.model.loader import load_model
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Access, TransportConfig, create_transport

log = logs.get_logger(__name__)


@contextlib.asynccontextmanager
async def decode_service(config: DecodeConfig) -> AsyncIterator[DecodeService]:
    """Model, KV pool over transport memory, NATS, subscriptions and loops: ready to serve."""
    worker_id = config.worker_id or new_worker_id(config.role)
    config = tp_config(config)
    placed = config.cpu_placement().apply()  # first: torch's and asyncio's threads inherit it
    if placed:
        log.info("cpu placement", applied=", ".join(placed))
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    disagg = config.mode == "disagg"  # colocated workers take no remote writes: no data plane
    # what peers on other hosts dial (a colocated worker has no data plane to reach)
    bind_host, advertise_host = config.transport_hosts() if disagg else ("127.0.0.1",) * 2
    tconf = TransportConfig(
        peer_id=worker_id, tcp_host=bind_host, tcp_advertise_host=advertise_host
    )
    subjects = config.subjects
    hearing = Hearing(connected_since=time.monotonic())
    started_at = time.time()
    async with (
        create_transport(config.transport, tconf)
        if disagg
        else contextlib.nullcontext() as transport,
        connect_nats(
            config.nats_url, worker_id, security=config.nats_security, hearing=hearing
        ) as nc,
    ):
        # "starting" until the model is loaded and the pool made: a restarted worker is
        # coming, not gone, and routers wait for it (docs/faults.md)
        async with background(
            heartbeat_loop(
                nc,
                subjects,
                config.role,
                worker_id,
                lambda: WorkerHeartbeat(
                    worker_id,
                    config.role,
                    WorkerLoad(WorkerState.STARTING),
                    started_at=started_at,
                    sent_at=time.time(),
                ),
                config.heartbeat_s,
            )
        ):
            model, tokenizer = await asyncio.to_thread(
                load_model, config.model,
                parse_dtype(config.dtype, "--dtype") if config.dtype else None, config.device,
            )  # fmt: skip
            # --tp N: N rank processes, this one the leader (docs/tp.md)
            ranks = await DecodeRanks.start(config, worker_id, model) if config.tp > 1 else None
            engine = build_engine(config, model, tokenizer, transport)
            if ranks is not None:
                engine = ranks.lead(engine)
        region = transport.register(engine.kv_pool.raw, Access.REMOTE_WRITE) if disagg else None
        metrics = DecodeMetrics()
        lock = asyncio.Lock()  # the engine's: the worker's, and the puts' and swap-ins' later
        parts = DecodeParts(config, engine, worker_id, nc, transport, region, metrics, lock)
        features = compose_features(parts)
        block_bytes = engine.kv_pool.spec.block_bytes
        worker = DecodeWorker(
            engine,
            worker_id=worker_id,
            base_addr=region.addr if region else engine.kv_pool.base_addr,
            colocated=not disagg,
            windows=lease_windows(ranks, transport, region, block_bytes),
            quarantine_s=config.quarantine_s,
            metrics=metrics,
            hooks=features.hooks,
            lock=lock,
            reads=features.reads,
            wake=parts.wake,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            resume_window_s=(
                config.heartbeat_s if config.resume_window_s is None else config.resume_window_s
            ),
        )
        service = DecodeService(
            config,
            worker,
            transport,
            nc,
            hearing,
            features=with_ranks(features.features, ranks and ranks.serve(worker)),
            reach=DecodeReach(
                descriptor=transport.descriptor().public() if transport else None,
                block_bytes=block_bytes,
                block_size=engine.kv_pool.spec.block_size,
                kv_spec=engine.kv_spec,
                model_spec=model_spec(model.config),
            ),
            started_at=started_at,
        )
        await service.load()
        service.tg = asyncio.TaskGroup()
        site = Site(nc, subjects, worker_id)
        shell = WorkerShell(
            service,
            ready="decode worker ready",
            control=service.on_control,
            endpoints=(
                ("reserve", subjects.decode_reserve(worker_id), service.on_reserve),
                (
                    "stream_resume",
                    subjects.decode_stream_resume(worker_id),
                    service.on_stream_resume,
                ),
            ),
            routes=(
                (subjects.decode_prefill_done(worker_id), PrefillDone, service.on_prefill_done),
                (subjects.ABORT, Abort, service.on_abort),
                (
                    subjects.decode_prefill_started(worker_id),
                    PrefillStarted,
                    service.on_prefill_started,
                ),
                (subjects.REGISTRY_WORKER_GONE, WorkerGone, service.on_worker_gone),
                (subjects.decode_lease_renew(worker_id), LeaseRenew, service.on_lease_renew),
                (subjects.decode_lease_cancel(worker_id), LeaseCancel, service.on_lease_cancel),
                *service.features.routes(site),
            ),
            contexts=(*service.features.contexts(site), service.tg, service.handover.subscribed()),
            loops=(
                service.engine_loop,
                service.lease_loop,
                service.completion_loop,
                *service.features.loops(site),
            ),
            # Advertised only once ``reserve`` answers: a router that saw the advert finds it.
            after_ready=(service.advert_loop,),
            metadata={"mode": config.mode},
            ready_fields={
                "mode": config.mode,
                "speculative": config.speculative,
                "transport": transport.name if transport else None,
                "num_blocks": engine.config.num_blocks,
                "kv_spec": engine.kv_spec,
            },
        )
        async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
            yield service
        worker.close()
        await service.features.aclose()  # before the client closes


async def run(config: DecodeConfig) -> None:
    async with decode_service(config) as service:
        await serve_until_signal()
        await service.drain(config.drain_timeout_s)
