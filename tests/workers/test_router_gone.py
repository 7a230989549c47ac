"""A router that dies takes its requests with it (issue 43 #4): pure and in-process parts.

Each request carries its router's instance (PlaceRequest.router, on to the reservation and the
prefill job); the registry's WorkerGone for a router carries it too. The decode worker then
aborts that router's sequences and frees their blocks (a reservation no prefill worker took at
once), the prefill worker stops its jobs and refuses later ones, the registry drops its leases.
The mesh test (kill -9 of a router under load) is tests/mesh/test_mesh_member_deaths.py.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate
from kvmesh.shared.bus.messages.placement import PlaceRequest, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob, PrefillStarted
from kvmesh.shared.bus.messages.workers import WorkerHeartbeat, WorkerLoad
from kvmesh.shared.text.sampling import SamplingOptions
from test_decode_pending import _drive, _Events
from test_restarting_decode import advert


@pytest.fixture
def decode_worker(tiny):
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    return DecodeWorker(engine, worker_id="d0", base_addr=engine.kv_pool.base_addr), _Events()


def _reserve(rid: str, n: int, router: str, *, local: bool = False, max_tokens: int = 4):
    opts = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = tuple(range(1, n + 1))
    return ReserveRequest(rid, prompt, opts, local, "L" + rid, 30_000, router=router)


async def test_decode_drops_a_gone_routers_sequences_and_frees_their_blocks(decode_worker):
    worker, rec = decode_worker
    free = worker.engine.block_manager.num_free_blocks
    assert (await worker.reserve(_reserve("run", 5, "rt1", local=True, max_tokens=500))).ok
    assert (await worker.reserve(_reserve("queued", 40, "rt1"))).ok  # its job not taken yet
    assert (await worker.reserve(_reserve("written", 40, "rt1"))).ok
    worker.on_prefill_started(PrefillStarted("written", "Lwritten", "prefill-0"))
    assert (await worker.reserve(_reserve("other", 5, "rt2", local=True, max_tokens=8))).ok
    rec.events += await worker.admit()
    while not any(e.token_ids for e in rec.tokens("run")):
        rec.events += await worker.step()
    assert worker.on_router_gone("") == []  # a WorkerGone without an instance drops nothing
    rec.events += worker.on_router_gone("rt1")
    await _drive(worker, rec)
    assert rec.tokens("run")[-1].finish_reason == "abort"  # cut short, not decoded to the end
    assert sum(len(e.token_ids) for e in rec.tokens("run")) < 500
    assert rec.tokens("queued") == [] and "queued" not in worker.pending  # freed at once
    assert "written" in worker.pending  # its writer stops on the same WorkerGone, then says so
    worker.on_prefill_done(PrefillDone("written", "Lwritten", False, error="aborted"))
    await _drive(worker, rec)
    assert "written" not in worker.pending and rec.tokens("written")[-1].finish_reason == "abort"
    assert rec.tokens("other")[-1].finish_reason == "length"  # another router's: untouched
    assert sum(len(e.token_ids) for e in rec.tokens("other")) == 8
    assert worker.engine.block_manager.num_free_blocks == free
    assert len(worker.requests) == 0  # nothing of them is kept
    reply = await worker.reserve(_reserve("queued", 40, "rt1"))  # a late copy: refused
    assert not reply.ok and "aborted" in reply.error


async def test_requests_that_end_are_forgotten_by_router(decode_worker):
    worker, rec = decode_worker
    assert (await worker.reserve(_reserve("a", 5, "rt1", local=True))).ok
    assert (await worker.reserve(_reserve("b", 40, "rt1"))).ok
    worker.on_prefill_done(PrefillDone("b", "Lb", False, error="x"))
    await _drive(worker, rec)
    assert len(worker.requests) == 0
    assert worker.on_router_gone("rt1") == []


def test_the_registry_drops_a_gone_routers_leases_and_names_its_instance():
    registry = RegistryState(worker_timeout_s=3.0, retry_after_s=0.5)
    registry.observe_advert(advert("d0"), now=0.0)
    beat = WorkerHeartbeat(
        worker_id="router-0",
        role="router",
        load=WorkerLoad("ready"),
        started_at=5.0,
        instance="rt1",
    )
    registry.observe_heartbeat(beat, now=0.0)
    for rid, router in (("r1", "rt1"), ("r2", "rt2")):
        request = PlaceRequest(
            rid, tuple(range(16)), SamplingOptions(), False, lease_ms=60_000, router=router
        )
        choice = registry.choose(request, now=0.0)
        assert isinstance(choice, Candidate)
        registry.grant(choice, request, "L" + rid, (0,), now=0.0)
    assert registry.instance_of("router-0") == "rt1" and registry.instance_of("d0") == ""
    registry.observe_advert(advert("d0"), now=2.9)
    assert registry.expire(now=3.1) == (["router-0"], [])
    assert list(registry.leases) == ["Lr2"] and registry.counters.dropped == 1
    # restarted under its id: the old instance's leases go at the new one's first heartbeat
    registry.observe_heartbeat(beat, now=4.0)
    request = PlaceRequest("r3", tuple(range(16)), SamplingOptions(), False, router="rt1")
    choice = registry.choose(request, now=4.0)
    assert isinstance(choice, Candidate)
    registry.grant(choice, request, "Lr3", (1,), now=4.0)
    again = msgspec.structs.replace(beat, started_at=6.0, instance="rt9")
    assert registry.observe_heartbeat(again, now=4.5) == "router"
    assert list(registry.leases) == ["Lr2"]


async def test_prefill_refuses_a_job_of_a_gone_router(tiny):
    from kvmesh.services.prefill.worker import PrefillWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=16))
    worker = PrefillWorker(engine, None, None, worker_id="p0", kv_spec="s", advert_wait_s=0.01)
    descriptor = TransportDescriptor("d0", "h", (TcpBackend("127.0.0.1", 1, "ab" * 32),))
    job = PrefillJob(
        "r1", (1, 2, 3), SamplingOptions(), "d0", "L1", descriptor, 7, (0,), 4096, 0.0, "rt1"
    )
    assert await worker.on_router_gone("rt1") == 0  # no job of it in hand
    result = await worker.prefill(job)
    assert result is not None and not result.done.ok and "router is gone" in result.done.error
    assert result.done.rkey == 7 and result.done.num_writes == 0  # the decode worker frees
    other = await worker.prefill(msgspec.structs.replace(job, request_id="r2", router="rt2"))
    assert other is not None and "router is gone" not in other.done.error  # refused otherwise
    # queued after the announcement: its router lives (it was counted gone while cut off)
    later = msgspec.structs.replace(job, request_id="r3", enqueued_at=time.time() + 1)
    result = await worker.prefill(later)
    assert result is not None and "router is gone" not in result.done.error


def test_a_router_heartbeating_slower_than_the_registry_is_not_dropped_between_beats():
    """A restarted registry (or one with a shorter interval) has not learned a router's interval
    from its first heartbeat; the interval the heartbeat says counts from the start."""
    registry = RegistryState(worker_timeout_s=0.9, missed_heartbeats=3)
    beat = WorkerHeartbeat(
        worker_id="router-0",
        role="router",
        load=WorkerLoad("ready"),
        instance="rt1",
        interval_s=2.0,
    )
    registry.observe_heartbeat(beat, now=0.0)
    assert registry.expire(now=5.9) == ([], [])  # 3 x 2 s
    assert registry.expire(now=6.1) == (["router-0"], [])
