"""Segments (buckets, mix versus rate) and the TTFT phase breakdown of missed requests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.attribution import (
    INFLIGHT_EDGES,
    PHASES,
    PROMPT_TOKEN_EDGES,
    attainment_by_segment,
    bucket_index,
    bucket_labels,
    mix_rate_decomposition,
    mix_rate_decomposition_rates,
    phase_arrays,
    phase_breakdown,
    phase_breakdown_from_sums,
)
from analysis.stats import wilson_interval

# ---------------------------------------------------------------------------------------------
# Mix versus rate


def test_variant_that_only_got_easier_traffic_is_all_mix():
    # Same per-segment attainment in both; the variant got far more short prompts.
    rate = {"short": 0.98, "long": 0.70}
    control = {"short": (5000, int(5000 * rate["short"])), "long": (5000, int(5000 * 0.70))}
    variant = {"short": (8000, int(8000 * rate["short"])), "long": (2000, int(2000 * 0.70))}
    out = mix_rate_decomposition(control, variant)
    assert out["total"] == pytest.approx((7840 + 1400) / 10000 - (4900 + 3500) / 10000)
    assert out["total"] > 0.08
    assert out["rate"] == pytest.approx(0.0, abs=1e-12)
    assert out["mix"] == pytest.approx(out["total"])
    assert out["dominant"] == "mix"
    assert "mostly because it got different traffic" in out["text"]


def test_variant_that_is_really_better_in_every_segment_is_all_rate():
    control = {"short": (5000, 4500), "long": (5000, 3500)}
    variant = {"short": (5000, 4750), "long": (5000, 3750)}
    out = mix_rate_decomposition(control, variant)
    assert out["mix"] == pytest.approx(0.0, abs=1e-12)
    assert out["rate"] == pytest.approx(0.05)
    assert out["dominant"] == "rate"


def test_simpsons_paradox_better_everywhere_but_worse_overall():
    # Variant wins in both segments, loses overall because it got the hard traffic.
    control = {"short": (9000, 8100), "long": (1000, 500)}
    variant = {"short": (1000, 950), "long": (9000, 5400)}
    out = mix_rate_decomposition(control, variant)
    assert out["total"] < 0
    assert out["rate"] > 0 and out["mix"] < 0
    assert all(s["rate"] > 0 for s in out["segments"].values())


def test_a_segment_seen_by_only_one_variant_counts_as_mix():
    control = {"short": (100, 90)}
    variant = {"short": (50, 45), "huge": (50, 10)}
    out = mix_rate_decomposition(control, variant)
    assert out["segments"]["huge"]["rate"] == 0.0
    assert out["segments"]["huge"]["rate_a"] is None
    assert out["mix"] + out["rate"] == pytest.approx(out["total"])
    assert out["total"] == pytest.approx(55 / 100 - 90 / 100)


counts = st.tuples(st.integers(0, 10_000), st.floats(0, 1)).map(lambda t: (t[0], int(t[0] * t[1])))


@settings(max_examples=200, deadline=None)
@given(
    a=st.dictionaries(st.sampled_from("abcdef"), counts, min_size=1),
    b=st.dictionaries(st.sampled_from("abcdef"), counts, min_size=1),
)
def test_mix_plus_rate_is_exactly_the_overall_attainment_difference(a, b):
    na, nb = sum(n for n, _ in a.values()), sum(n for n, _ in b.values())
    if na == 0 or nb == 0:
        with pytest.raises(ValueError, match="both sides need samples"):
            mix_rate_decomposition(a, b)
        return
    out = mix_rate_decomposition(a, b)
    direct = sum(h for _, h in b.values()) / nb - sum(h for _, h in a.values()) / na
    assert out["mix"] + out["rate"] == pytest.approx(direct, abs=1e-9)
    assert out["total"] == pytest.approx(direct, abs=1e-9)


def test_mix_rate_on_a_mean_metric_uses_rates_directly():
    out = mix_rate_decomposition_rates({"s": (10, 100.0), "l": (10, 300.0)}, {"s": (30, 100.0)})
    assert out["total"] == pytest.approx(100.0 - 200.0)
    assert out["rate"] == 0.0


def test_bad_segment_counts_are_named():
    with pytest.raises(ValueError, match="segment 'x' of b has hits=5, n=3"):
        mix_rate_decomposition({"x": (3, 1)}, {"x": (3, 5)})


# ---------------------------------------------------------------------------------------------
# Buckets


def test_bucket_index_counts_edges_at_or_below_like_the_clickhouse_arraycount():
    values = np.array([0, 127, 128, 511, 512, 2047, 2048, 8191, 8192, 10**6])
    idx = bucket_index(values, PROMPT_TOKEN_EDGES)
    brute = [sum(e <= v for e in PROMPT_TOKEN_EDGES) for v in values]
    assert idx.tolist() == brute == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    labels = bucket_labels(PROMPT_TOKEN_EDGES)
    assert labels == ["<128", "128-512", "512-2048", "2048-8192", ">=8192"]
    assert len(bucket_labels(INFLIGHT_EDGES)) == len(INFLIGHT_EDGES) + 1


def test_unsorted_edges_are_rejected():
    with pytest.raises(ValueError, match="strictly increasing"):
        bucket_index([1, 2], [10, 5])


def test_attainment_by_segment_gives_wilson_per_bucket_and_keeps_empty_ones():
    out = attainment_by_segment({"<128": (200, 190), "128-512": (0, 0)})
    ci = wilson_interval(190, 200)
    assert out["<128"] == {"n": 200, "hits": 190, "attainment": 0.95, "lo": ci.lo, "hi": ci.hi}
    assert out["128-512"]["attainment"] is None


# ---------------------------------------------------------------------------------------------
# Phases


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


def test_phase_breakdown_shares_against_hand_computation():
    ph = {
        "schedule_lag": [0.0, 100.0],
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
