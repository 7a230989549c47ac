"""A worker's ``control`` endpoint (``control_endpoint``, what every WorkerShell serves) answers
``kvmesh admin drain|resume`` after announcing its new state on its heartbeat subject, against a
real nats-server: the router's worker pool must not
wait for the next heartbeat tick to learn it (a router that heard one prefill worker's drain but
not yet another's resume counted none ready and prefilled on the decode worker)."""

from __future__ import annotations

import time

import nats.micro
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.workers import WorkerControl, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.worker_shell import control_endpoint
from kvmesh.shared.config.subjects import Subjects

SUBJECTS = Subjects("kvmesh-tiny")


async def test_the_new_state_is_heard_on_the_heartbeat_subject_before_the_answer(
    nats_server: str,
) -> None:
    state = {"state": "ready"}
    applied: list[str] = []

    def heartbeat() -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id="prefill-1",
            role="prefill",
            load=WorkerLoad(state["state"]),
            sent_at=time.time(),
        )

    async def apply(action: str) -> None:
        applied.append(action)
        state["state"] = "draining" if action == "drain" else "ready"

    async with (
        connect_nats(nats_server, "worker") as nc_worker,
        connect_nats(nats_server, "router") as nc,
    ):
        svc = await nats.micro.add_service(nc_worker, name="kvmesh-prefill", version="0.0.0")
        name, subject, handler = control_endpoint(
            nc_worker, SUBJECTS, "prefill-1", heartbeat, apply
        )
        assert (name, subject) == ("control", SUBJECTS.worker_control("prefill-1"))
        await svc.add_endpoint(name=name, subject=subject, handler=handler)
        await flush_to_server(nc_worker)  # one flush may return before the SUB is in
        # no heartbeat loop runs: only the control answer can have published one
        beats = await nc.subscribe(SUBJECTS.heartbeat("prefill", "prefill-1"))
        for action, expected in (("drain", "draining"), ("resume", "ready")):
            control = encode_message(WorkerControl(action))
            msg = await nc.request(SUBJECTS.worker_control("prefill-1"), control, timeout=5)
            answer = decode_message(msg.data, WorkerHeartbeat)
            assert answer.load.state == expected
            # one connection hears messages in the order the server sent them: already queued
            beat = await beats.next_msg(timeout=0.05)
            assert decode_message(beat.data, WorkerHeartbeat).load.state == expected
        bad = encode_message(WorkerControl("pause"))
        msg = await nc.request(SUBJECTS.worker_control("prefill-1"), bad, timeout=5)
        assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400"
        assert beats.pending_msgs == 0  # a refused control changes nothing, so announces nothing
        assert applied == ["drain", "resume"]
        await svc.stop()
