"""services/router/request_events.py: the four subjects the router reads of one attempt, each
decoded into its one type; a malformed body names the type it should have been; anything else
under the attempt's subjects, or another attempt's, is not the router's business."""

from __future__ import annotations

import pytest
from kvmesh.services.router.request_events import AttemptEvents, MalformedEvent
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.config.subjects import Subjects

subjects = Subjects("ev")
EVENTS = {
    subjects.request_tokens("r1"): TokenEvent("r1", (5, 6), finish_reason="length"),
    subjects.request_prefill_report("r1"): PrefillReport("r1", "p0", 0.1, 0.2, 0.3, 0.0, 2),
    subjects.request_prefill_started("r1"): PrefillStarted("r1", "lease-1", "p0"),
    subjects.request_worker_gone("r1"): WorkerGone("d0", "decode", 3.5),
}


@pytest.mark.parametrize("subject", EVENTS)
def test_each_subject_decodes_into_its_own_type(subject: str) -> None:
    sent = EVENTS[subject]
    assert AttemptEvents(subjects, "r1").decode(subject, encode_message(sent)) == sent


@pytest.mark.parametrize("subject", EVENTS)
def test_a_body_of_another_type_is_malformed_and_names_the_expected_type(subject: str) -> None:
    other = next(e for s, e in EVENTS.items() if type(e) is not type(EVENTS[subject]))
    with pytest.raises(MalformedEvent) as bad:
        AttemptEvents(subjects, "r1").decode(subject, encode_message(other))
    assert bad.value.kind is type(EVENTS[subject])
    assert type(EVENTS[subject]).__name__ in str(bad.value.error)


def test_a_body_that_is_not_json_is_malformed() -> None:
    with pytest.raises(MalformedEvent) as bad:
        AttemptEvents(subjects, "r1").decode(subjects.request_tokens("r1"), b"\xff{")
    assert bad.value.kind is TokenEvent and "not JSON" in str(bad.value)


@pytest.mark.parametrize(
    "subject",
    [
        f"{subjects.request_events('r1')}.draft_kv",  # another kind of request event
        subjects.request_tokens("r1-r1"),  # the next attempt's: a retry listens anew
        subjects.request_tokens("r2"),
    ],
)
def test_other_subjects_are_not_the_routers_business(subject: str) -> None:
    data = encode_message(EVENTS[subjects.request_tokens("r1")])
    assert AttemptEvents(subjects, "r1").decode(subject, data) is None
