"""``kvmesh bench spec``'s decode-phase rate: tokens after each request's first over the time from
the earliest first token to the latest end."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.bench_spec import decode_phase
from kvmesh.loadgen.serve_metrics import RequestRecord


def _record(first_token_s: float, end_s: float, num_tokens: int) -> RequestRecord:
    return RequestRecord(
        index=0,
        arrival_s=0.0,
        send_s=0.0,
        end_s=end_s,
        prompt_len=10,
        output_len=num_tokens,
        num_output_tokens=num_tokens,
        chunk_times=(first_token_s, end_s),
    )


def test_decode_phase_leaves_out_each_first_token_and_the_time_before_it():
    tokens, seconds = decode_phase([_record(1.5, 3.5, 101)])
    assert (tokens, seconds) == (100, pytest.approx(2.0))


def test_decode_phase_of_a_batch_spans_earliest_first_token_to_latest_end():
    tokens, seconds = decode_phase([_record(1.0, 3.0, 11), _record(2.0, 5.0, 21)])
    assert (tokens, seconds) == (30, pytest.approx(4.0))
