"""The TTFT phase breakdown of missed requests (analysis.phases)."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.definitions import PHASES
from analysis.phases import phase_arrays, phase_breakdown, phase_breakdown_from_sums


def test_phase_arrays_split_ttft_plus_lag_exactly():
    ph = phase_arrays(
        schedule_lag_ms=[5.0, 0.0],
        connect_ms=[20.0, None],  # second request reused a connection
        ttfb_ms=[50.0, 30.0],
        ttft_event_ms=[250.0, 60.0],
        ttft_ms=[300.0, 61.0],
    )
    assert ph["connect"].tolist() == [20.0, 0.0]
    assert ph["headers"].tolist() == [30.0, 30.0]
    assert ph["headers_to_first_event"].tolist() == [200.0, 30.0]
    assert ph["first_event_to_first_content"].tolist() == [50.0, 1.0]
    total = sum(ph[p] for p in PHASES)
    assert total.tolist() == [305.0, 61.0]


def test_a_live_request_s_time_in_the_gateway_is_its_own_phase_before_the_send():
    """A live sample's gateway_ms comes before the StreamResult clock as a replay's schedule lag
    does: the phases sum to the client's TTFT, gateway_ms + ttft_ms."""
    ph = phase_arrays(
        schedule_lag_ms=[0.0, 0.0],
        connect_ms=[None, None],
        ttfb_ms=[50.0, 30.0],
        ttft_event_ms=[250.0, 60.0],
        ttft_ms=[300.0, 61.0],
        gateway_ms=[2.5, 0.25],
    )
    assert ph["gateway"].tolist() == [2.5, 0.25] and ph["schedule_lag"].tolist() == [0.0, 0.0]
    assert sum(ph[p] for p in PHASES).tolist() == [302.5, 61.25]
    out = phase_breakdown(ph)
    assert out["phases"]["gateway"]["label"] == "gateway"
    assert out["phases"]["gateway"]["mean_ms"] == pytest.approx(1.375)
    assert PHASES.index("gateway") < PHASES.index("connect")  # before the request is written


def test_phase_breakdown_shares_against_hand_computation():
    ph = {
        "schedule_lag": [0.0, 100.0],
        "gateway": [0.0, 0.0],
        "connect": [0.0, 0.0],
        "headers": [100.0, 100.0],
        "headers_to_first_event": [300.0, 0.0],
        "first_event_to_first_content": [0.0, 0.0],
    }
    out = phase_breakdown(ph)
    h = out["phases"]["headers"]
    assert h["mean_ms"] == 100.0
    assert h["mean_share"] == pytest.approx((100 / 400 + 100 / 200) / 2)
    assert h["share_of_total"] == pytest.approx(200 / 600)
    assert sum(p["mean_share"] for p in out["phases"].values()) == pytest.approx(1.0)
    sums = {k: float(np.sum(v)) for k, v in ph.items()}
    from_sums = phase_breakdown_from_sums(sums, count=2)
    for p in PHASES:
        assert from_sums["phases"][p]["share_of_total"] == pytest.approx(out["phases"][p]["share_of_total"])
        assert from_sums["phases"][p]["mean_ms"] == pytest.approx(out["phases"][p]["mean_ms"])


def test_phase_breakdown_drops_requests_without_a_first_event_and_counts_them():
    ph = phase_arrays(None, [None, None], [10.0, 10.0], [20.0, None], [30.0, None])
    out = phase_breakdown(ph)
    assert out["n"] == 1 and out["dropped"] == 1


def test_out_of_order_timestamps_are_an_error_naming_the_phase():
    ph = phase_arrays(None, [50.0], [10.0], [20.0], [30.0])  # headers before connect finished
    with pytest.raises(ValueError, match="negative durations in \\['headers'\\]"):
        phase_breakdown(ph)


def test_unknown_phase_names_are_rejected():
    with pytest.raises(ValueError, match="unknown \\['dns'\\]"):
        phase_breakdown_from_sums({**dict.fromkeys(PHASES, 1.0), "dns": 1.0}, 1)
