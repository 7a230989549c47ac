"""Resuming a stream through another router, the pure parts: the SSE event ids
(services/router/stream_ids.py), the decode worker's log of each stream's events
(services/decode/stream_log.py) and the replay cut where the client stopped
(services/router/stream_resume.py). The whole path, with a router killed mid-stream:
tests/mesh/test_mesh_stream_resume.py."""

from __future__ import annotations

import pytest
from kvmesh.services.decode.stream_log import StreamLog
from kvmesh.services.router.errors import InvalidRequestError
from kvmesh.services.router.stream_ids import DONE, FINISH, TOKENS, USAGE, EventId, EventIds
from kvmesh.services.router.stream_resume import StreamExpiredError, resume_events
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.token_streams import StreamReplay, TokenEvent
from kvmesh.shared.bus.wire_ids import attempt_of, is_migrated, wire_id
from kvmesh.shared.text.sampling import TokenLogprobs

RID = "chatcmpl-" + "ab" * 12


def event(wire: str, tokens: tuple[int, ...], made: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent(wire, tokens, finish_reason=finish, num_output_tokens=made)


# --- event ids ---------------------------------------------------------------------------------


def test_event_id_round_trips_and_orders_by_tokens_then_slot():
    eid = EventId(RID, 12, FINISH)
    assert EventId.parse(str(eid), "chat") == eid
    assert EventId(RID, 12, DONE).point > EventId(RID, 12, FINISH).point > (11, DONE)


@pytest.mark.parametrize(
    "text",
    ["", "chatcmpl-xyz:1:0", f"{RID}:1", f"{RID}:-1:0", f"{RID}:1:9", f"{RID}:1:0\nid: x"],
)
def test_a_malformed_last_event_id_is_a_400_that_shows_the_shape(text: str):
    with pytest.raises(InvalidRequestError, match="Last-Event-ID must be the id of an event"):
        EventId.parse(text, "chat")


def test_a_last_event_id_of_the_other_route_says_where_to_resume_it():
    with pytest.raises(InvalidRequestError, match="resume it there"):
        EventId.parse(f"{RID}:3:0", "completion")


def test_a_resumed_stream_sends_only_the_events_past_the_clients_last():
    ids = EventIds(RID, after=(5, TOKENS))
    assert ids.next(3, TOKENS) is None and ids.next(5, TOKENS) is None
    assert str(ids.next(5, FINISH)) == f"{RID}:5:{FINISH}"
    assert ids.next(6, TOKENS) == EventId(RID, 6, TOKENS)
    assert EventIds(RID).next(0, TOKENS) == EventId(RID, 0, TOKENS)  # a fresh stream: all


def test_wire_ids_name_their_request_and_whether_they_migrated():
    assert attempt_of(wire_id(RID, "m", 3)) == (RID, 3)
    assert is_migrated(f"{RID}-m3") and not is_migrated(f"{RID}-r2") and not is_migrated(RID)


# --- the decode worker's log ---------------------------------------------------------------------


def test_the_log_replays_every_event_of_the_latest_attempt_of_a_request():
    log = StreamLog(grace_s=10.0)
    log.record(event(RID, (1,), 1), now=0.0)
    log.record(event(f"{RID}-r1", (7,), 1), now=0.5)  # run again: the latest attempt
    log.record(event(f"{RID}-r1", (8, 9), 3), now=1.0)
    assert log.find(RID, now=1.0) == (f"{RID}-r1", False)
    replay = log.replay(f"{RID}-r1", num_prompt_tokens=4, now=1.0)
    assert [e.token_ids for e in replay.events] == [(7,), (8, 9)] and not replay.error
    assert log.find("chatcmpl-" + "cd" * 12, now=1.0) == ("", False)  # unknown


def test_an_ended_stream_is_kept_for_its_grace_then_told_expired():
    log = StreamLog(grace_s=10.0)
    log.record(event(RID, (1, 2), 2, finish="length"), now=0.0)
    assert log.find(RID, now=9.0)[0] == RID
    assert len(log.replay(RID, 1, now=9.0).events) == 1
    assert log.find(RID, now=10.5) == ("", True)  # forgotten, and known to be
    assert len(log) == 0


def test_a_stream_longer_than_the_log_keeps_cannot_be_resumed_and_holds_nothing():
    log = StreamLog(max_tokens=4)
    log.record(event(RID, (1, 2, 3), 3), now=0.0)
    log.record(event(RID, (4, 5), 5), now=0.1)
    replay = log.replay(RID, 1, now=0.2)
    assert replay.events == () and "too long to resume" in replay.error
    assert "--resume-max-tokens" in replay.error


def test_an_aborted_stream_cannot_be_resumed():
    log = StreamLog()
    log.record(event(RID, (1,), 1), now=0.0)
    log.record(TokenEvent(RID, (), finish_reason="abort", error="router gone"), now=0.1)
    assert "'abort' (router gone)" in log.replay(RID, 1, now=0.2).error


def test_a_migrated_attempt_hands_back_the_output_its_prompt_carries():
    log = StreamLog()
    wire = f"{RID}-m2"
    assert log.wants_prompt(wire) and not log.wants_prompt(RID)
    log.record(event(wire, (30,), 1), now=0.0, prompt_ids=(1, 2, 3, 10, 20))
    assert not log.wants_prompt(wire)  # its first event only
    replay = log.replay(wire, num_prompt_tokens=3, now=0.1)
    assert replay.prior_token_ids == (10, 20) and [e.token_ids for e in replay.events] == [(30,)]
    assert "not the same request" in log.replay(wire, num_prompt_tokens=9, now=0.1).error


def test_the_oldest_ended_streams_go_first_past_the_bound():
    log = StreamLog(max_streams=2)
    others = ["cmpl-" + f"{i:024x}" for i in range(3)]
    for i, rid in enumerate(others):
        log.record(event(rid, (1,), 1, finish="stop"), now=float(i))
    assert [log.find(r, now=3.0)[0] for r in others] == ["", others[1], others[2]]


# --- the replay cut where the client stopped ------------------------------------------------------


def test_the_event_the_client_stopped_in_is_cut_at_its_last_token():
    lps = tuple(TokenLogprobs(-float(i)) for i in range(3))
    replay = StreamReplay(
        events=(
            event(RID, (1, 2), 2),
            TokenEvent(RID, (3, 4, 5), "stop", num_output_tokens=5, logprobs=lps),
        )
    )
    cut = resume_events(replay, EventId(RID, 3, TOKENS), wants_logprobs=True, wire_id=RID)
    assert [e.token_ids for e in cut] == [(1, 2), (3,), (4, 5)]
    assert [e.finish_reason for e in cut] == [None, None, "stop"]
    assert cut[1].logprobs == lps[:1] and cut[2].logprobs == lps[1:]


def test_a_migrated_streams_earlier_output_leads_the_replay():
    replay = StreamReplay(events=(event(f"{RID}-m1", (9,), 1),), prior_token_ids=(7, 8))
    cut = resume_events(replay, EventId(RID, 1, TOKENS), False, f"{RID}-m1")
    assert [e.token_ids for e in cut] == [(7,), (8,), (9,)]
    with pytest.raises(StreamExpiredError, match="logprobs"):
        resume_events(replay, EventId(RID, 1, TOKENS), True, f"{RID}-m1")


def test_an_id_past_what_the_stream_made_is_refused():
    replay = StreamReplay(events=(event(RID, (1, 2), 2),))
    with pytest.raises(InvalidRequestError, match=r"names token 5 .* has made 2"):
        resume_events(replay, EventId(RID, 5, TOKENS), False, RID)


# --- a gone router's streams: detached for the resume window -------------------------------------


def _worker(tiny):
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    now = [0.0]
    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    worker = DecodeWorker(
        engine,
        worker_id="d0",
        base_addr=engine.kv_pool.base_addr,
        clock=lambda: now[0],
        resume_window_s=1.0,
    )
    return worker, now


async def _streaming(worker, rid: str, router: str, events: list[TokenEvent]) -> None:
    from kvmesh.shared.text.sampling import SamplingOptions

    opts = SamplingOptions(max_tokens=500, temperature=0.0, ignore_eos=True)
    req = ReserveRequest(rid, (1, 2, 3, 4), opts, True, "L" + rid, 30_000, router=router)
    assert (await worker.reserve(req)).ok
    events += await worker.admit()
    while not any(e.token_ids for e in events if e.request_id == rid):
        events += await worker.step()


async def test_a_gone_routers_stream_decodes_on_for_the_window_then_is_aborted(tiny):
    worker, now = _worker(tiny)
    events: list[TokenEvent] = []
    await _streaming(worker, "kept", "rt1", events)
    await _streaming(worker, "dropped", "rt1", events)
    assert worker.on_router_gone("rt1") == [] and worker.num_detached == 2
    worker.hand_over("kept", "rt2")  # a client resumed it through router rt2
    events += await worker.step()
    assert not any(e.finish_reason for e in events)  # both decode on within the window
    now[0] = 1.0
    events += worker.expire_detached()
    for _ in range(3):
        events += await worker.admit()
        events += await worker.step()
    ends = {e.request_id: e.finish_reason for e in events if e.finish_reason}
    assert ends == {"dropped": "abort"}  # nobody resumed it; the resumed one goes on
    assert worker.on_router_gone("rt2") == [] and worker.num_detached == 1  # rt2's now


# --- the ids a router's streams carry (the fake mesh) ----------------------------------------------


def _ids(raw: bytes) -> list[EventId]:
    events = raw.strip().split(b"\n\n")
    assert all(e.startswith(b"id: ") for e in events), raw[:200]
    return [EventId.parse(e[4:].split(b"\n", 1)[0].decode(), "chat") for e in events]


async def test_every_event_of_a_chat_stream_carries_an_ordered_id(nats_server):
    from test_router_service import MODEL, mesh_and_router

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with mesh_and_router(nats_server) as (_, _, http):
        resp = await http.post(
            "/v1/chat/completions",
            json={**chat, "stream": True, "stream_options": {"include_usage": True}},
        )
        ids = _ids(await resp.read())
        plain = await http.post("/v1/chat/completions", json={**chat, "n": 2, "stream": True})
        assert b"id: " not in await plain.read()  # n > 1: not resumable, no ids
        refused = await http.post("/v1/chat/completions", json=chat, headers={"Last-Event-ID": "x"})
        body = await refused.json()
    assert ids[0].point == (0, TOKENS)  # the role chunk
    assert [i.slot for i in ids[-3:]] == [FINISH, USAGE, DONE] and ids[-1].num_tokens == 5
    assert [i.point for i in ids] == sorted({i.point for i in ids})  # growing, none twice
    assert len({i.request_id for i in ids}) == 1
    assert refused.status == 400 and "stream: true" in body["error"]["message"]
