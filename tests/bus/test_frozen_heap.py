"""``kvmesh serve`` serves with its start-up heap frozen (``frozen_heap``): what exists on entry is
out of the collector's reach, what serving makes is not, and leaving unfreezes it."""

from __future__ import annotations

import argparse
import gc
import weakref

import orjson
from kvmesh.loadgen.bench_gc import register_gc

from kvmesh.commands.serve import frozen_heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    """An unreachable reference cycle (only a collection frees it); a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_start_up_heap_is_frozen_while_serving_and_unfrozen_after():
    with frozen_heap():
        assert gc.get_freeze_count() > 1000  # this process's imports, pytest's and torch's
        during = _cycle()  # serving's garbage is still collected
        gc.collect()
        assert during() is None
    assert gc.get_freeze_count() == 0


def test_frozen_heap_unfreezes_when_serving_fails():
    try:
        with frozen_heap():
            raise RuntimeError("the service failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_bench_gc_prints_both_pauses_and_their_ratio(capsys):
    parser = argparse.ArgumentParser()
    register_gc(parser.add_subparsers())
    args = parser.parse_args(["gc", "--json", "--repeats", "1", "--live-objects", "100"])
    assert args.func(args) == 0
    result = orjson.loads(capsys.readouterr().out)
    assert result["start_up_objects"] > 10_000
    assert result["unfrozen_ms"] >= 0 and result["frozen_ms"] >= 0  # the figures: the benchmark's
    assert gc.get_freeze_count() == 0


def test_bench_gc_refuses_bad_counts(capsys):
    parser = argparse.ArgumentParser()
    register_gc(parser.add_subparsers())
    args = parser.parse_args(["gc", "--repeats", "0"])
    assert args.func(args) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
