"""Hearing: silence counts only while a service is connected to NATS (pure)."""

from __future__ import annotations

from kvmesh.shared.bus.hearing import Hearing


def test_silence_is_the_time_since_the_last_message_while_connected():
    hearing = Hearing(connected_since=0.0)
    assert hearing.silence(10.0, 13.5) == 3.5


def test_no_silence_counts_while_disconnected():
    hearing = Hearing(connected_since=0.0)
    hearing.on_disconnected(12.0)
    assert not hearing.is_connected
    assert hearing.silence(10.0, 30.0) == 0.0


def test_after_a_reconnect_silence_counts_from_the_reconnect():
    hearing = Hearing(connected_since=0.0)
    hearing.on_disconnected(10.5)
    hearing.on_reconnected(20.0)
    assert hearing.last_outage_s == 9.5
    assert hearing.silence(10.0, 21.0) == 1.0  # not 11 s: 10 of them were an outage
    assert hearing.silence(20.5, 21.0) == 0.5  # heard since: from its message
    assert hearing.num_outages == 1


def test_a_second_disconnect_notice_is_one_outage():
    hearing = Hearing()
    hearing.on_disconnected(1.0)
    hearing.on_disconnected(2.0)
    hearing.on_reconnected(5.0)
    assert hearing.num_outages == 1 and hearing.last_outage_s == 4.0
