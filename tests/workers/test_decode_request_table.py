"""The decode worker's request table (services/decode/request_table.py): one entry per request,
its phase, its router and its timers, moved only by the table's transitions."""

from __future__ import annotations

import pytest
from kvmesh.services.decode.pending import Reservation, Verdict
from kvmesh.services.decode.request_table import RequestPhase, RequestTable
from kvmesh.shared.text.sampling import SamplingOptions

OPTS = SamplingOptions(max_tokens=4)


def _reserved(table: RequestTable, rid: str, router: str = "") -> Reservation:
    table.add(rid, RequestPhase.RESERVED, (1, 2, 3), OPTS, router=router)
    return Reservation(rid, "L" + rid, slot=7, block_ids=(0,), deadline=10.0)


def _phases(table: RequestTable) -> dict[str, RequestPhase]:
    return {e.request_id: e.phase for p in RequestPhase for e in table.in_phase(p)}


def test_a_local_prefill_goes_queued_then_running_then_ends_with_its_final_event():
    table = RequestTable()
    table.add("a", RequestPhase.READING, (1, 2), OPTS, router="rt1")
    table.add("b", RequestPhase.QUEUED, (1,), OPTS, lease_id="Lb")
    table.read_ended("a")  # queued after b: admit() goes in the order they were queued
    assert [e.request_id for e in table.in_phase(RequestPhase.QUEUED)] == ["b", "a"]
    assert table.needs_admit
    table.started("b")
    table.started("a")
    assert _phases(table) == {"b": RequestPhase.RUNNING, "a": RequestPhase.RUNNING}
    assert table.get("b").lease_id == ""  # in the engine: no lease to cancel any more
    assert not table.needs_admit
    table.end("a")
    table.end("a")  # a second final event (a further choice) finds nothing
    assert "a" not in table and len(table) == 1


def test_a_request_enters_only_once_and_only_by_an_entry_phase():
    table = RequestTable()
    table.add("a", RequestPhase.QUEUED, (1,), OPTS)
    with pytest.raises(ValueError, match="already in the table"):
        table.add("a", RequestPhase.RESERVED, (1,), OPTS)
    with pytest.raises(ValueError, match="reading, queued or reserved, not running"):
        table.add("b", RequestPhase.RUNNING, (1,), OPTS)


def test_a_verdict_to_admit_or_to_tell_settles_the_reservation_with_its_time():
    table = RequestTable()
    ok = Verdict(_reserved(table, "ok"), True)
    failed = Verdict(_reserved(table, "failed"), False, "prefill failed")
    table.settle(ok, now=5.0)
    table.settle(failed, now=6.0)
    settled = table.in_phase(RequestPhase.SETTLED)
    assert [(e.request_id, e.verdict, e.settled_at) for e in settled] == [
        ("ok", ok, 5.0),
        ("failed", failed, 6.0),
    ]
    assert table.take_releases() == []
    table.started("ok")
    table.end("failed")
    assert _phases(table) == {"ok": RequestPhase.RUNNING} and table.get("ok").verdict is None


def test_a_verdict_that_owes_nobody_a_word_ends_the_request_and_only_frees_blocks():
    table = RequestTable()
    silent = Verdict(_reserved(table, "gone", router="rt1"), False, "writer died", notify=False)
    table.settle(silent, now=1.0)
    assert "gone" not in table and table.needs_admit
    # a quarantine that ends after its request ended: blocks only
    late = Verdict(Reservation("old", "Lold", 3, (1,), 0.0), False, "expired", notify=False)
    table.settle(late, now=2.0)
    assert table.take_releases() == [silent, late]
    assert table.take_releases() == [] and not table.needs_admit


def test_an_abort_ends_a_request_not_yet_in_the_engine_and_reports_where_it_was():
    table = RequestTable()
    table.add("q", RequestPhase.QUEUED, (1, 2), OPTS, router="rt1")
    table.add("r", RequestPhase.READING, (1,), OPTS)
    assert table.abort("q", now=0.0) is RequestPhase.QUEUED
    assert table.abort("r", now=0.0) is RequestPhase.READING
    assert len(table) == 0
    assert "aborted before its reservation arrived" in table.refusal("q", "L2", now=1.0)


def test_an_abort_leaves_a_reservation_to_its_lease_and_fails_a_settled_one():
    table = RequestTable()
    _reserved(table, "res", router="rt1")
    ok = Verdict(_reserved(table, "set", router="rt1"), True)
    table.settle(ok, now=0.0)
    assert table.abort("res", now=0.0) is RequestPhase.RESERVED
    assert table.abort("set", now=0.0) is RequestPhase.SETTLED
    assert _phases(table) == {"res": RequestPhase.RESERVED, "set": RequestPhase.SETTLED}
    assert ok.lease.is_aborted  # admit() fails it instead of admitting it
    assert table.of_router("rt1") == []  # nobody streams them any more


def test_an_abort_of_a_running_or_unknown_request_waits_for_admit_to_reach_the_engine():
    table = RequestTable()
    table.add("run", RequestPhase.QUEUED, (1,), OPTS)
    table.started("run")
    assert table.abort("run", now=0.0) is RequestPhase.RUNNING
    assert table.abort("choice", now=0.0) is None  # unknown here: the engine may hold choices
    assert table.needs_admit
    assert "choice" not in table  # not held: a reservation for it is refused as aborted
    assert table.take_aborting() == ["run", "choice"]
    assert _phases(table) == {"run": RequestPhase.RUNNING}
    assert not table.needs_admit


def test_a_cancelled_lease_drops_its_queued_local_prefill_and_refuses_it_later():
    table = RequestTable()
    table.add("a", RequestPhase.QUEUED, (1,), OPTS, lease_id="La")
    assert not table.cancel_queued("a", "Lother", now=0.0)
    assert table.cancel_queued("a", "La", now=0.0)
    assert "a" not in table
    assert "gave up on lease La" in table.refusal("a", "La", now=1.0)
    assert table.refusal("a", "Lnew", now=1.0) == ""


def test_a_gone_routers_streams_are_detached_and_the_rest_returned_to_abort():
    table = RequestTable()
    for rid, router in (("s1", "rt1"), ("s2", "rt1"), ("q", "rt1"), ("other", "rt2")):
        table.add(rid, RequestPhase.QUEUED, (1,), OPTS, router=router)
        table.started(rid)
    assert table.router_gone("", 0.0, {"s1"}, 1.0) == []  # an instance-less announcement
    assert table.router_gone("rt1", 0.0, {"s1", "s2", "other"}, 1.0) == ["q"]
    assert table.num_detached == 2 and table.of_router("rt1") == []
    assert table.hand_over("s1", "rt3")  # its client resumed it there
    assert not table.hand_over("q", "rt3")  # nobody streams it: not detached, no router
    assert table.take_expired_detached(now=0.5) == []
    assert table.take_expired_detached(now=1.0) == ["s2"]
    assert table.num_detached == 0
    assert [e.request_id for e in table.of_router("rt3")] == ["s1"]
    assert table.router_gone("rt2", 0.0, {"other"}, 0.0) == ["other"]  # no resume window


def test_an_abort_forgets_the_requests_router_and_its_detach():
    table = RequestTable()
    table.add("s", RequestPhase.QUEUED, (1,), OPTS, router="rt1")
    table.started("s")
    assert table.router_gone("rt1", 0.0, {"s"}, 5.0) == []
    table.abort("s", now=1.0)
    assert table.num_detached == 0 and table.take_expired_detached(now=9.0) == []
    assert not table.hand_over("s", "rt2")  # its final event is on the way: not resumable
