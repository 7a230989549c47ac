"""Placements that find no room wait in arrival order (issue 43, item 3): once the oldest has
waited ``aging_s``, later requests are placed only where it still fits after them, so an old big
request is served as soon as its blocks free, before later small ones
(services/kv_registry/waiting_line.py, core.py)."""

from __future__ import annotations

from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate, Refusal
from kvmesh.services.kv_registry.waiting_line import WaitingLine
from test_registry_core import advert, place

BIG, SMALL = 16 * 16, 3 * 16  # tokens: 16 and 3 blocks of 16


def ask(core: RegistryState, line: WaitingLine, request_id: str, tokens: int, now: float) -> bool:
    """One placement as the registry's Placement.place makes it; whether it was placed."""
    head = line.head_before(request_id, now)
    choice = core.choose(
        place(tokens, request_id=request_id), now, held_tokens=head.num_tokens if head else 0
    )
    if isinstance(choice, Refusal):
        line.wait(request_id, tokens, now)
        return False
    assert isinstance(choice, Candidate)
    core.release_inflight(choice)  # the test frees blocks itself, by adverts
    line.leave(request_id)
    return True


def test_old_big_request_is_placed_before_later_small_ones_once_its_blocks_free() -> None:
    core, line = RegistryState(worker_timeout_s=60.0), WaitingLine(aging_s=1.0)
    core.observe_advert(advert("d", free_blocks=10), now=0.0)
    assert not ask(core, line, "big", BIG, now=0.0)  # 16 blocks needed, 10 free
    assert ask(core, line, "small-1", SMALL, now=0.5)  # the big one has not waited long yet
    # from 1 s on the big one heads the line: small ones that would keep it out wait too
    assert not ask(core, line, "small-2", SMALL, now=1.5)
    core.observe_advert(advert("d", free_blocks=17), now=2.0)  # room frees
    assert not ask(core, line, "small-3", SMALL, now=2.1)  # asked first, but 17 - 3 < 16
    assert ask(core, line, "big", BIG, now=2.2)
    assert ask(core, line, "small-2", SMALL, now=2.3)  # then the line moves on


def test_later_request_is_placed_where_it_leaves_room_for_the_head() -> None:
    core, line = RegistryState(worker_timeout_s=60.0), WaitingLine(aging_s=0.0)
    core.observe_advert(advert("a", free_blocks=10), now=0.0)
    core.observe_advert(advert("b", free_blocks=10), now=0.0)
    assert not ask(core, line, "big", BIG, now=0.0)
    assert not ask(core, line, "small", SMALL, now=0.1)  # the head fits nowhere: all wait
    core.observe_advert(advert("b", free_blocks=17), now=0.2)
    # "a" takes the small one and "b" still has the big one's 16 blocks
    choice = core.choose(place(SMALL, request_id="small"), 0.3, held_tokens=BIG)
    assert isinstance(choice, Candidate) and choice.worker_id == "a"
    core.release_inflight(choice)


def test_waiting_line_keeps_arrival_order_and_forgets_who_stopped_asking() -> None:
    line = WaitingLine(aging_s=1.0, forget_s=5.0)
    line.wait("first", 100, now=0.0)
    line.wait("second", 10, now=0.5)
    assert line.head_before("new", now=0.9) is None  # nobody has waited 1 s yet
    assert line.head_before("new", now=1.0).request_id == "first"
    assert line.head_before("second", now=1.0).request_id == "first"
    assert line.head_before("first", now=1.0) is None  # nobody is ahead of the head
    line.wait("first", 100, now=4.0)  # asking again keeps its place
    line.wait("second", 10, now=4.0)
    line.wait("second", 10, now=9.5)
    assert line.head_before("new", now=9.5).request_id == "second"  # first gave up at 9 s
    line.leave("second")
    assert line.head_before("new", now=9.5) is None and line.waiters == {}
