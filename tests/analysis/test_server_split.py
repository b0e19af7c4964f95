"""The miss split by the server's own queue and prefill (analysis.server_metrics.server_split):
the server counts a request when it finishes, at the next scrape, so the misses sent in a time
bucket are matched with the server's increases over that bucket and the next."""

from __future__ import annotations

import pytest

from analysis.server_metrics import server_split

PHASES = {
    "phases": {
        k: {"mean_ms": v}
        for k, v in {
            "schedule_lag": 1.0,
            "gateway": 0.0,
            "connect": 0.5,
            "headers": 2.0,
            "headers_to_first_event": 120.0,
            "first_event_to_first_content": 3.0,
        }.items()
    }
}


def test_misses_whose_requests_the_server_counted_in_the_next_bucket_are_covered():
    # 10 misses sent in second 4; the server's histograms grew at the scrape in second 5 only
    server = {5: {"queue": [0.5, 10.0], "prefill": [0.8, 10.0]}}
    out = server_split(PHASES, {4: 10}, server, bucket_s=1)
    assert out["available"] and out["covered_misses"] == out["misses"] == 10
    assert out["phases"]["server_queue"]["mean_ms"] == pytest.approx(50.0)
    assert out["phases"]["server_prefill"]["mean_ms"] == pytest.approx(80.0)


def test_adjacent_buckets_are_pooled_by_their_counts():
    server = {
        4: {"queue": [0.2, 2.0], "prefill": [0.2, 2.0]},
        5: {"queue": [1.8, 18.0], "prefill": [1.8, 18.0]},
    }
    out = server_split(PHASES, {4: 5}, server, bucket_s=1)
    assert out["phases"]["server_queue"]["mean_ms"] == pytest.approx(100.0)  # 2.0 s over 20 requests


def test_misses_far_from_any_server_increase_stay_uncovered():
    server = {9: {"queue": [0.5, 10.0], "prefill": [0.8, 10.0]}}
    out = server_split(PHASES, {4: 10, 8: 2}, server, bucket_s=1)
    assert out["misses"] == 12 and out["covered_misses"] == 2  # bucket 8 sees bucket 9; bucket 4 nothing
    none = server_split(PHASES, {4: 10}, {}, bucket_s=1)
    assert not none["available"] and none["covered_misses"] == 0 and "no server metrics" in none["why"]
