"""The one Prometheus text reader (``loadgen/prom_text.py``): totals, series and samples of a
page, a malformed line skipped without losing the rest."""

from __future__ import annotations

from kvmesh.loadgen import prom_text

PAGE = """\
# HELP kvmesh_x_total Things.
# TYPE kvmesh_x_total counter
kvmesh_x_total{role="decode"} 2
kvmesh_x_total{role="prefill"} 3
kvmesh_x_created 1.7e9
kvmesh_h_bucket{le="1.0"} 1
kvmesh_h_sum 2.5
not a sample line
kvmesh_y notanumber
kvmesh_z{path="a} b"} 4 1700000000000
kvmesh_g 7
"""


def test_totals_sum_labelled_series_and_leave_out_buckets_and_timestamps():
    assert prom_text.totals(PAGE) == {
        "kvmesh_x_total": 5.0,
        "kvmesh_h_sum": 2.5,
        "kvmesh_z": 4.0,
        "kvmesh_g": 7.0,
    }


def test_series_key_every_sample_by_its_labels():
    series = prom_text.series(PAGE)
    assert series['kvmesh_x_total{role="decode"}'] == 2.0
    assert series['kvmesh_h_bucket{le="1.0"}'] == 1.0
    assert series['kvmesh_z{path="a} b"}'] == 4.0
    assert "kvmesh_y" not in series


def test_samples_keep_the_labels():
    buckets = [s for s in prom_text.samples(PAGE) if s.name == "kvmesh_h_bucket"]
    assert [(s.labels, s.value) for s in buckets] == [({"le": "1.0"}, 1.0)]
