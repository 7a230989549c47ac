"""scripts/tap_link.py's pure part: when a frame leaves the user-space link, or that it is lost."""

from __future__ import annotations

import random

import pytest
from support.netns_harness import load_script


def _tap_link():
    return load_script("tap_link")


def test_frame_leaves_after_the_delay_when_nothing_is_lost():
    model = _tap_link().LinkModel(0.001, 0.0, random.Random(0))
    assert [model.departure(t) for t in (0.0, 0.5, 2.0)] == [0.001, 0.501, 2.001]


def test_loss_drops_about_the_asked_share_of_frames():
    model = _tap_link().LinkModel(0.0, 10.0, random.Random(1))
    lost = sum(model.departure(0.0) is None for _ in range(20_000))
    assert 1_700 < lost < 2_300, lost


def test_full_loss_drops_every_frame_and_none_drops_none():
    link = _tap_link()
    assert all(
        link.LinkModel(0.0, 100.0, random.Random(2)).departure(0.0) is None for _ in range(100)
    )
    assert all(link.LinkModel(0.0, 0.0, random.Random(2)).departure(0.0) == 0.0 for _ in range(100))


@pytest.mark.parametrize(("delay_s", "loss_pct"), [(-0.001, 0.0), (0.0, -1.0), (0.0, 100.5)])
def test_link_refuses_a_negative_delay_or_a_loss_outside_0_to_100(delay_s, loss_pct):
    with pytest.raises(ValueError, match=r"delay|loss"):
        _tap_link().LinkModel(delay_s, loss_pct, random.Random(0))


def test_interface_name_longer_than_15_bytes_is_refused_before_any_device_is_made():
    with pytest.raises(ValueError, match="longer than 15"):
        _tap_link().open_tap("x" * 16)
