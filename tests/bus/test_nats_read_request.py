"""shared/bus/nats_request.read_request: a request body decoded as its message type, or a 400
that names the type and the field, and nothing for the handler."""

from __future__ import annotations

import asyncio

import pytest
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.workers import WorkerControl
from kvmesh.shared.bus.nats_request import read_request


class Request:
    """What read_request uses of nats.micro's Request: the body and respond_error."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.errors: list[tuple[str, str]] = []

    async def respond_error(self, code: str, description: str) -> None:
        self.errors.append((code, description))


def test_a_well_formed_body_is_decoded_and_nothing_answered() -> None:
    req = Request(encode_message(WorkerControl(action="drain")))
    assert asyncio.run(read_request(req, WorkerControl)) == WorkerControl(action="drain")
    assert req.errors == []


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b'{"action": 3}', "WorkerControl.action: expected str, got int"),
        (b"not json", "WorkerControl: body is not JSON"),
    ],
)
def test_a_malformed_body_is_a_400_that_names_the_type_and_field(data: bytes, says: str) -> None:
    req = Request(data)
    assert asyncio.run(read_request(req, WorkerControl)) is None
    ((code, description),) = req.errors
    assert code == "400" and says in description
