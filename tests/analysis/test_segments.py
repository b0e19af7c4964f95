"""Segments: buckets, attainment per bucket, mix versus rate (analysis.segments)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.definitions import INFLIGHT_EDGES, PROMPT_TOKEN_EDGES
from analysis.segments import (
    attainment_by_segment,
    bucket_index,
    bucket_labels,
    mix_rate_decomposition,
    mix_rate_decomposition_rates,
)
from stats.proportions import wilson_interval

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
