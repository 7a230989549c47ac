"""The hypervisor's stolen share of CPU time between two /proc/stat readings."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.cpu_steal import CpuTimes, read_cpu_times, steal_share, steal_share_over

STAT = "cpu  {u} 0 {s} {i} 0 0 0 {st} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1\n"


def test_the_aggregate_line_gives_total_and_steal():
    assert CpuTimes.parse(STAT.format(u=100, s=50, i=800, st=50)) == CpuTimes(1000, 50)


def test_steal_share_is_the_stolen_part_of_the_time_between_readings():
    before = CpuTimes.parse(STAT.format(u=100, s=50, i=800, st=50))
    after = CpuTimes.parse(STAT.format(u=200, s=70, i=1080, st=150))
    assert steal_share(before, after) == pytest.approx(100 / 500)
    assert steal_share(before, before) is None  # no time passed
    assert steal_share(None, after) is None


def test_a_stat_without_steal_or_cpu_line_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no steal field"):
        CpuTimes.parse("cpu  1 2 3 4\n")
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        CpuTimes.parse("intr 1\n")
    bad = tmp_path / "stat"
    bad.write_text("intr 1\n")
    assert read_cpu_times(bad) is None
    assert read_cpu_times(tmp_path / "missing") is None


def test_this_machine_reads():
    times = read_cpu_times()
    if times is None:
        pytest.skip("no /proc/stat here")
    assert times.total > 0 and 0 <= times.steal <= times.total


def test_steal_over_several_spans_weighs_each_by_its_time():
    a0, a1 = CpuTimes(0, 0), CpuTimes(100, 50)  # 50 % of a short span
    b0, b1 = CpuTimes(1000, 50), CpuTimes(1900, 50)  # none of a long one
    assert steal_share_over([(a0, a1), (b0, b1)]) == pytest.approx(50 / 1000)
    assert steal_share_over([(a0, None)]) is None
    assert steal_share_over([]) is None
