import asyncio
import contextlib

import pytest
from kvmesh.services.decode.pending import Admission, PendingTable, ReservationError
from kvmesh.shared.bus.messages.codec import decode_message
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.kv.imm import imm_slot, pack_imm
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport.completions import Completion

ADMISSION = Admission((1, 2, 3), SamplingOptions(max_tokens=4))


def _done(rid="r1", lease="l1", ok=True, num_writes=3, first_token=7, error=""):
    return PrefillDone(rid, lease, ok, first_token=first_token, num_writes=num_writes, error=error)


def _table(deadline=10.0):
    table = PendingTable()
    table.add("r1", "l1", slot=5, block_ids=(4, 5, 6), deadline=deadline, admission=ADMISSION)
    return table


def test_ready_once_all_immediates_counted_after_done():
    table = _table()
    assert table.on_done(_done(num_writes=3)) is None
    assert table.on_immediate(5, 0) is None
    assert table.on_immediate(5, 1) is None
    verdict = table.on_immediate(5, 2)
    assert verdict is not None and verdict.ok
    assert verdict.lease.admission is ADMISSION and verdict.lease.done.first_token == 7
    assert len(table) == 0


def test_ready_when_done_arrives_after_every_immediate():
    table = _table()
    for chunk in (2, 0, 1):  # order across chunks does not matter
        assert table.on_immediate(5, chunk) is None
    verdict = table.on_done(_done(num_writes=3))
    assert verdict is not None and verdict.ok
    assert "r1" not in table


def test_not_ready_while_writes_missing():
    table = _table()
    table.on_immediate(5, 0)
    assert table.on_done(_done(num_writes=2)) is None
    assert "r1" in table


def test_immediates_are_counted_per_request():
    table = _table()
    table.add("r2", "l2", slot=9, block_ids=(1,), deadline=10.0)
    table.on_immediate(5, 0)
    assert table.on_done(_done("r2", "l2", num_writes=1)) is None
    verdict = table.on_immediate(9, 0)
    assert verdict.ok and verdict.lease.request_id == "r2"
    assert table.get("r1").num_writes == 1


def test_failed_prefill_returns_reservation_with_error():
    table = _table()
    table.on_immediate(5, 0)
    verdict = table.on_done(_done(ok=False, num_writes=1, first_token=-1, error="boom"))
    assert verdict is not None and not verdict.ok and verdict.error == "boom"
    assert verdict.lease.block_ids == (4, 5, 6)


def test_failed_prefill_frees_without_waiting_for_lagging_immediates():
    # the prefill sends PrefillDone after its writes returned, i.e. the bytes are placed
    table = _table()
    verdict = table.on_done(_done(ok=False, num_writes=2, first_token=-1, error="aborted"))
    assert verdict is not None and not verdict.ok
    assert table.on_immediate(5, 0) is None and table.num_stray_immediates == 1


def test_more_writes_than_announced_fails():
    table = _table()
    table.on_immediate(5, 0)
    table.on_immediate(5, 1)
    verdict = table.on_done(_done(num_writes=1))
    assert verdict is not None and not verdict.ok and "2 arrived" in verdict.error


def test_duplicate_chunk_fails():
    table = _table()
    table.on_immediate(5, 1)
    verdict = table.on_immediate(5, 1)
    assert verdict is not None and not verdict.ok and "twice" in verdict.error
    assert len(table) == 0


def test_stray_immediate_is_counted_not_applied():
    table = _table()
    assert table.on_immediate(77, 0) is None
    assert table.num_stray_immediates == 1
    assert table.get("r1").num_writes == 0


def test_done_with_wrong_lease_is_ignored():
    table = _table()
    assert table.on_done(_done(lease="other", num_writes=0)) is None
    assert table.get("r1").done is None


def test_success_without_first_token_fails():
    table = _table()
    assert table.on_immediate(5, 0) is None
    verdict = table.on_done(_done(num_writes=1, first_token=-1))
    assert verdict is not None and not verdict.ok and "first token" in verdict.error


def test_success_without_any_write_fails():
    table = _table()
    verdict = table.on_done(_done(num_writes=0, first_token=3))
    assert verdict is not None and not verdict.ok and "without any KV write" in verdict.error


def test_lease_expiry_returns_only_overdue_reservations():
    table = _table(deadline=5.0)
    table.add("r2", "l2", slot=6, block_ids=(1, 2), deadline=20.0)
    assert table.next_deadline() == 5.0
    assert table.expire(4.9) == []
    expired = table.expire(5.0)
    assert [v.lease.request_id for v in expired] == ["r1"]
    assert not expired[0].ok and "no PrefillDone" in expired[0].error
    assert expired[0].notify and not expired[0].release  # quarantined: a late write may land
    assert table.num_reserved_blocks() == 3 + 2 and table.next_deadline() == 20.0


def test_expired_blocks_return_once_the_prefill_says_it_stopped():
    table = _table(deadline=1.0)  # r1 expects writes at slot 5
    [told] = table.expire(1.0)
    assert told.notify and not told.release
    assert table.on_done(_done(num_writes=2)) is None  # stopped, one write still in flight
    [verdict] = [table.on_immediate(5, 0), table.on_immediate(5, 1)][1:]
    assert verdict is not None and verdict.release and not verdict.notify
    assert "r1" not in table


def test_expired_blocks_return_after_the_quarantine_without_word_from_the_prefill():
    table = PendingTable(quarantine_s=10.0)
    table.add("r1", "l1", slot=5, block_ids=(3, 4), deadline=1.0)
    [told] = table.expire(1.0)
    assert not told.release and table.next_deadline() == 11.0
    assert table.expire(10.9) == []
    [freed] = table.expire(11.0)
    assert freed.release and not freed.notify and "r1" not in table


def test_abort_keeps_blocks_until_prefill_stops():
    table = _table()
    table.on_immediate(5, 0)
    assert table.abort("r1") is None  # a write may still be in flight
    verdict = table.on_done(_done(ok=False, num_writes=1, first_token=-1, error="aborted"))
    assert verdict is not None and not verdict.ok


def test_abort_after_successful_prefill_does_not_admit():
    table = _table()
    table.abort("r1")
    table.on_done(_done(num_writes=1))
    verdict = table.on_immediate(5, 0)
    assert verdict is not None and not verdict.ok and verdict.error == "aborted"


def test_aborted_reservation_expires_as_aborted():
    table = _table(deadline=1.0)
    table.abort("r1")
    [verdict] = table.expire(2.0)
    assert verdict.error == "aborted"


def test_duplicate_request_and_busy_slot_are_refused():
    table = _table()
    with pytest.raises(ReservationError, match="already holds"):
        table.add("r1", "l2", slot=8, block_ids=(), deadline=1.0)
    with pytest.raises(ReservationError, match="slot 5"):
        table.add("r2", "l2", slot=5, block_ids=(), deadline=1.0)


def test_slot_freed_with_its_reservation():
    table = _table()
    table.expire(100.0)  # quarantined: late writes at slot 5 still belong to r1
    with pytest.raises(ReservationError, match="slot 5"):
        table.add("r2", "l2", slot=5, block_ids=(), deadline=1.0)
    table.expire(100.0 + table.quarantine_s)
    table.add("r2", "l2", slot=5, block_ids=(), deadline=1.0)  # no error


# ---- DecodeWorker: the engine and the pending table together, no NATS ------------------------


class _Events:
    """The TokenEvents the worker returned, as the service would have published them."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []

    def add(self, event: TokenEvent | None) -> None:
        if event is not None:
            self.events.append(event)

    def tokens(self, request_id: str) -> list[TokenEvent]:
        return [e for e in self.events if e.request_id == request_id]


@pytest.fixture
def decode_worker(tiny):
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    now = [100.0]
    worker = DecodeWorker(
        engine, worker_id="d0", base_addr=engine.kv_pool.base_addr, clock=lambda: now[0]
    )
    return worker, _Events(), now


async def _drive(worker, events: _Events, max_steps: int = 10_000) -> None:
    """What the service's engine loop does, until the worker has nothing left to do."""
    for _ in range(max_steps):
        if worker.is_idle:
            return
        events.events += await worker.admit()
        events.events += await worker.step()
    raise AssertionError(f"the worker was still busy after {max_steps} steps")


def _reserve(rid, n, local=False, lease_ms=1000):
    opts = SamplingOptions(max_tokens=4, temperature=0.0)
    return ReserveRequest(rid, tuple(range(1, n + 1)), opts, local, "L" + rid, lease_ms)


async def test_worker_admits_after_writes_and_done_then_streams_and_frees(decode_worker):
    worker, rec, _ = decode_worker
    reply = await worker.reserve(_reserve("a", 40))
    assert reply.ok and len(reply.block_ids) == 3
    assert worker.engine.block_manager.num_free_blocks == 61
    slot = imm_slot(worker.base_addr + reply.block_ids[0] * worker.block_bytes, worker.block_bytes)
    worker.on_completion(Completion(pack_imm(slot, 0), "p0", 1))
    worker.on_prefill_done(PrefillDone("a", "La", True, first_token=65, num_writes=2))
    assert "a" in worker.pending  # one write still to land
    worker.on_completion(Completion(pack_imm(slot, 1), "p0", 1))
    await _drive(worker, rec)
    events = rec.tokens("a")
    assert events[0].token_ids == (65,)  # the prefill's first token goes out first
    assert sum(len(e.token_ids) for e in events) == 4 and events[-1].finish_reason == "length"
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_worker_lease_expiry_frees_blocks_and_reports_error(decode_worker):
    worker, rec, now = decode_worker
    assert (await worker.reserve(_reserve("b", 20, lease_ms=500))).ok
    now[0] += 0.4
    assert worker.expire_leases() == []
    now[0] += 0.2
    aborts = worker.expire_leases()
    assert [a.request_id for a in aborts] == ["b"]  # the prefill is told to stop
    await _drive(worker, rec)
    [event] = rec.tokens("b")
    assert event.finish_reason == "error" and "lease ran out" in event.error
    # quarantined until the prefill confirms it stopped (it does, on the Abort)
    assert worker.engine.block_manager.num_free_blocks == 64 - 2
    worker.on_prefill_done(PrefillDone("b", "Lb", False, error="aborted"))
    await _drive(worker, rec)
    assert rec.tokens("b") == [event]  # nothing more reaches the client
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_worker_failed_prefill_returns_blocks(decode_worker):
    worker, rec, _ = decode_worker
    assert (await worker.reserve(_reserve("c", 33))).ok
    worker.on_prefill_done(PrefillDone("c", "Lc", False, error="KV spec mismatch: x"))
    await _drive(worker, rec)
    [event] = rec.tokens("c")
    assert event.finish_reason == "error" and "KV spec mismatch" in event.error
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_worker_local_prefill_and_abort_while_running(decode_worker):
    worker, rec, _ = decode_worker
    opts = SamplingOptions(max_tokens=500, temperature=0.0, ignore_eos=True)
    reply = await worker.reserve(ReserveRequest("d", (5, 6, 7), opts, True, "Ld", 1000))
    assert reply.ok and reply.block_ids == ()  # local prefill: nothing reserved for a writer
    rec.events += await worker.admit()
    while sum(len(e.token_ids) for e in rec.tokens("d")) < 3:
        rec.events += await worker.step()
    assert worker.abort("d") is None  # running: its final event comes with the next step
    await _drive(worker, rec)
    assert rec.tokens("d")[-1].finish_reason == "abort"
    assert sum(len(e.token_ids) for e in rec.tokens("d")) < 500
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_worker_refuses_reservations_while_draining_and_when_full(decode_worker):
    worker, _, _ = decode_worker
    worker.is_draining = True
    reply = await worker.reserve(_reserve("e", 10))
    assert not reply.ok and "draining" in reply.error
    worker.is_draining = False
    reply = await worker.reserve(_reserve("f", 16 * 65))
    assert not reply.ok and "out of KV blocks" in reply.error
    assert worker.engine.block_manager.num_free_blocks == 64


def test_free_block_ranges_are_sorted_runs():
    from kvmesh.services.decode.load import free_block_ranges

    assert free_block_ranges([5, 0, 1, 2, 7, 6, 9]) == ((0, 3), (5, 8), (9, 10))
    assert free_block_ranges([]) == ()


def test_decode_config_from_flags_and_env():
    import argparse

    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.shared.config.service_config import (
        ConfigError,
        add_config_arguments,
        config_from_args,
    )

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DecodeConfig)
    args = parser.parse_args(["--num-blocks", "128", "--mode", "colocated"])
    config = config_from_args(
        DecodeConfig, args, {"KVMESH_TRANSPORT": "tcp", "KVMESH_NUM_BLOCKS": "9"}
    )
    assert (config.num_blocks, config.mode, config.transport, config.role) == (
        128,
        "colocated",
        "tcp",
        "colocated",
    )
    with pytest.raises(ConfigError, match="--transport rdma"):
        config_from_args(DecodeConfig, None, {"KVMESH_DEVICE": "cuda", "KVMESH_TRANSPORT": "tcp"})
    with pytest.raises(ConfigError, match="num_blocks must be in"):
        config_from_args(DecodeConfig, None, {"KVMESH_NUM_BLOCKS": str((1 << 20) + 1)})


def test_renewal_moves_the_deadline_and_only_for_the_lease_holder():
    table = _table(deadline=10.0)
    assert table.renew("r1", "l1", 25.0)
    assert table.expire(20.0) == []  # renewed: alive past its first deadline
    assert not table.renew("r1", "other-lease", 99.0)
    assert not table.renew("nobody", "l1", 99.0)
    assert table.renew("r1", "l1", 12.0)  # never earlier than it was
    [verdict] = table.expire(25.0)
    assert not verdict.ok and "lease ran out" in verdict.error
    assert not table.renew("r1", "l1", 99.0)  # an expired lease stays expired


async def test_worker_lease_renewal_keeps_a_slow_prefill_alive(decode_worker):
    worker, _, now = decode_worker
    assert (await worker.reserve(_reserve("a", 40, lease_ms=1000))).ok
    for _ in range(5):  # 5 s of queueing, renewed every 0.5 s
        now[0] += 0.5
        assert worker.renew("a", "La", 1000)
        assert worker.expire_leases() == []
    now[0] += 1.5  # the holder stopped renewing
    assert len(worker.expire_leases()) == 1


async def test_local_prefill_reserve_answers_while_a_step_holds_the_engine(decode_worker):
    worker, rec, _ = decode_worker
    async with worker._lock:  # what a long colocated step does for its whole duration
        reply = await asyncio.wait_for(worker.reserve(_reserve("c", 40, local=True)), 0.5)
        assert reply.ok
        assert (await asyncio.wait_for(worker.reserve(_reserve("c", 40, local=True)), 0.5)).error
        bad = await asyncio.wait_for(worker.reserve(_reserve("d", 300, local=True)), 0.5)
        assert not bad.ok and "outside the vocabulary" in bad.error
    await _drive(worker, rec)
    assert rec.tokens("c")[-1].finish_reason == "length"
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_abort_of_an_accepted_local_request_before_it_starts(decode_worker):
    worker, rec, _ = decode_worker
    async with worker._lock:
        assert (await worker.reserve(_reserve("c", 40, local=True))).ok
        rec.add(worker.abort("c"))
    assert rec.tokens("c")[-1].finish_reason == "abort"
    await _drive(worker, rec)
    assert "c" not in worker.engine.seqs


class _FakeNats:
    """Stands in for the NATS client of DecodeService: records what it publishes."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.finished = asyncio.Event()  # a final TokenEvent went out

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))
        if decode_message(data, TokenEvent).finish_reason:
            self.finished.set()


async def test_paced_engine_loop_starts_steps_no_closer_than_its_interval(tiny):
    import time

    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.service import DecodeService
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    config = DecodeConfig(mode="colocated", min_step_interval_ms=50.0)
    worker = DecodeWorker(
        LLMEngine(*tiny, EngineConfig(num_blocks=64)), worker_id="d0", base_addr=0
    )
    nc = _FakeNats()
    service = DecodeService(config, worker, None, nc)  # no transport, no NATS connection
    started = time.monotonic()
    assert (await worker.reserve(_reserve("p", 20, local=True))).ok  # 4 tokens: 4 steps
    loop = asyncio.create_task(service.engine_loop())
    try:
        await asyncio.wait_for(nc.finished.wait(), 60)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    assert time.monotonic() - started >= 3 * 0.05  # three gaps between four steps
    subject = config.subjects.request_tokens("p")
    events = [decode_message(d, TokenEvent) for s, d in nc.published]
    assert all(s == subject for s, _ in nc.published)
    assert sum(len(e.token_ids) for e in events) == 4 and events[-1].finish_reason == "length"


def test_reservations_of_a_dead_prefill_worker_fail_and_free_at_once():
    table = PendingTable(quarantine_s=30.0)
    table.add("a", "la", slot=1, block_ids=(1, 2), deadline=10.0)
    table.add("b", "lb", slot=2, block_ids=(3,), deadline=10.0)
    table.add("c", "lc", slot=3, block_ids=(4,), deadline=10.0)
    assert table.on_started("a", "la", "prefill-0")
    assert not table.on_started("a", "la", "prefill-9")  # the first taker keeps it
    assert not table.on_started("b", "wrong-lease", "prefill-0")
    assert table.on_started("c", "lc", "prefill-1")
    table.abort("a")  # aborted, waiting for the prefill to stop: it never will now
    [verdict] = table.on_writer_gone("prefill-0")
    assert verdict.lease.request_id == "a" and verdict.release and not verdict.notify
    assert table.on_writer_gone("prefill-0") == []
    [verdict] = table.on_writer_gone("prefill-1")
    assert not verdict.notify and "prefill worker prefill-1 died" in verdict.error
    assert "b" in table and len(table) == 1  # no known writer: the lease decides


async def test_worker_frees_blocks_when_their_prefill_worker_dies(decode_worker):
    worker, rec, _ = decode_worker
    assert (await worker.reserve(_reserve("a", 40))).ok
    assert worker.engine.block_manager.num_free_blocks == 61
    worker.on_prefill_started(PrefillStarted("a", "La", "prefill-0"))
    worker.on_worker_gone(WorkerGone("prefill-0", "prefill", 3.0))
    await _drive(worker, rec)
    assert rec.tokens("a") == []  # the router, told by the registry too, retries or fails it
    assert worker.engine.block_manager.num_free_blocks == 64


def test_aborted_reservation_whose_job_was_withdrawn_frees_at_once_unless_written():
    table = PendingTable(quarantine_s=30.0)
    table.add("a", "la", slot=1, block_ids=(1,), deadline=10.0)
    table.add("b", "lb", slot=2, block_ids=(2,), deadline=10.0)
    table.add("c", "lc", slot=3, block_ids=(3,), deadline=10.0)
    verdict = table.abort("a", job_withdrawn=True)
    assert verdict is not None and verdict.release and not verdict.notify and "a" not in table
    table.on_immediate(2, 0)  # b's writer already wrote: it must stop first
    assert table.abort("b", job_withdrawn=True) is None and "b" in table
    table.on_started("c", "lc", "prefill-0")  # c's job was taken: withdrawal cannot be true
    assert table.abort("c", job_withdrawn=True) is None and "c" in table


async def test_a_reservation_the_registry_gave_up_on_is_freed_at_once_or_refused_if_late(
    decode_worker,
):
    worker, rec, _ = decode_worker
    assert (await worker.reserve(_reserve("a", 40))).ok  # its reply came too late
    assert worker.engine.block_manager.num_free_blocks == 61
    assert not worker.cancel_lease("a", "L-other")  # another lease: not this reservation
    assert worker.cancel_lease("a", "La")
    await _drive(worker, rec)
    assert rec.tokens("a") == []  # the request lives on another worker: nothing to tell
    assert worker.engine.block_manager.num_free_blocks == 64
    # the cancel can overtake the reservation (a worker that was stopped): refused when it comes
    assert not worker.cancel_lease("b", "Lb")
    reply = await worker.reserve(_reserve("b", 40))
    assert not reply.ok and "gave up on lease Lb" in reply.error
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_a_reservation_that_arrives_after_its_abort_is_refused(decode_worker):
    worker, _, now = decode_worker
    assert worker.abort("a") is None  # nothing of it here yet
    reply = await worker.reserve(_reserve("a", 40))
    assert not reply.ok and "aborted before its reservation arrived" in reply.error
    assert worker.engine.block_manager.num_free_blocks == 64
    now[0] += 600  # long after: the id is forgotten (the memory is bounded in time)
    assert (await worker.reserve(_reserve("a", 40))).ok


def test_recent_ids_forget_after_their_ttl_and_beyond_their_bound():
    from kvmesh.shared.bus.recent_ids import RecentIds

    ids = RecentIds(ttl_s=10.0, max_ids=2)
    ids.add("a", 0.0)
    assert ids.seen("a", 9.0) and not ids.seen("a", 10.5)
    for key, at in (("x", 20.0), ("y", 21.0), ("z", 22.0)):
        ids.add(key, at)
    assert len(ids) == 2 and not ids.seen("x", 22.0) and ids.seen("y", 22.0)


async def test_a_local_prefill_the_registry_gave_up_on_is_dropped_before_it_starts(decode_worker):
    worker, rec, _ = decode_worker
    assert (await worker.reserve(_reserve("a", 20, local=True))).ok  # its reply came too late
    worker.cancel_lease("a", "La")
    await _drive(worker, rec)
    assert rec.tokens("a") == []  # never run here: the request lives on another worker
    assert worker.engine.block_manager.num_free_blocks == 64


async def test_a_nats_outage_postpones_every_lease_by_its_length(decode_worker):
    worker, _, now = decode_worker
    assert (await worker.reserve(_reserve("a", 20, lease_ms=1000))).ok  # due at 101.0
    now[0] += 0.9
    worker.postpone_leases(10.0)  # NATS was down 10 s: the router could not renew
    now[0] += 5.0
    assert worker.expire_leases() == []  # 5.9 s after the reservation, 1 s lease: still held
    now[0] += 5.2
    assert [a.request_id for a in worker.expire_leases()] == ["a"]


async def test_decode_advertises_the_moment_it_turns_busy_or_idle_not_a_heartbeat_later(tiny):
    """Prefill workers that borrow decode's idle cores (services/prefill/core_loan.py) hear it
    at once; an engine loop woken with nothing to step sends no extra advert."""
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.service import DecodeService
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    config = DecodeConfig(mode="colocated", heartbeat_s=60.0)
    worker = DecodeWorker(
        LLMEngine(*tiny, EngineConfig(num_blocks=64)), worker_id="d0", base_addr=0
    )
    nc = _FakeNats()
    service = DecodeService(config, worker, None, nc)
    adverts = asyncio.Queue()

    async def advertise() -> None:
        adverts.put_nowait(worker.has_unfinished)

    service.advertise = advertise
    loops = [asyncio.create_task(service.advert_loop()), asyncio.create_task(service.engine_loop())]
    try:
        assert await asyncio.wait_for(adverts.get(), 5) is False  # the first, at start
        assert (await worker.reserve(_reserve("p", 20, local=True))).ok
        assert await asyncio.wait_for(adverts.get(), 5) is True  # busy, and said so at once
        await asyncio.wait_for(nc.finished.wait(), 60)
        assert await asyncio.wait_for(adverts.get(), 5) is False  # idle, and said so at once
        worker._wake.set()  # woken with nothing to step: no advert
        await asyncio.sleep(0.2)
        assert adverts.empty()
    finally:
        for loop in loops:
            loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*loops)
