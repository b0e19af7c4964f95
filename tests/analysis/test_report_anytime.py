# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The report's anytime-valid intervals (analysis.anytime): computed from the raw samples with
stats.sequential independently, they are the same numbers on chDB and the ClickHouse server;
they sit beside the fixed-horizon ones and are wider; the sequential SRM test flags a broken
split and passes a correct one; arms with no samples render."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import anytime
from analysis import definitions as q
from analysis import report as r
from stats.sequential.means import MeanSequence, difference_interval
from stats.sequential.quantiles import SortedLatencies, quantile_difference_interval
from stats.sequential.srm import SrmSequence
from tests.analysis.fixtures_report import (  # noqa: F401 - fixtures
    SLO,
    backend,
    info,
    loaded_stores,
    mirror_data,
    mirror_spec,
    split_data,
    split_spec,
)

ALPHA = 0.05


def _arm(data, variant):
    c = data.latest()
    keep = c["variant"] == variant
    c = {k: v[keep] for k, v in c.items()}
    ok = c["outcome"] == "ok"
    with np.errstate(invalid="ignore"):
        hits = int((ok & (c["ttft_ms"] < SLO.ttft_ms)).sum())
    ttft = c["ttft_ms"][ok & ~np.isnan(c["ttft_ms"])]
    return int(keep.sum()), hits, int((~ok).sum()), ttft


@pytest.fixture
def split_report(backend):
    return r.build_report(backend, info(split_spec()), q.Filters("ttft-opt"))


def test_per_variant_sequences_match_stats_sequential_on_the_raw_samples(split_report, split_data):
    got = split_report["anytime"]
    assert got["alpha"] == ALPHA and "mid-run" in got["note"]
    control = split_report["experiment"]["control"]
    c_n, c_hits, c_err, c_ttft = _arm(split_data, control)
    for entry in split_report["variants"]:
        v = entry["key"]
        n, hits, errors, ttft = _arm(split_data, v)
        a = got["variants"][v]
        assert a["n"] == n == entry["n"]
        assert a["attainment"] == pytest.approx(
            MeanSequence(n=n, hits=hits, alpha=ALPHA).interval().as_dict()
        )
        assert a["error_rate"] == pytest.approx(
            MeanSequence(n=n, hits=errors, alpha=ALPHA).interval().as_dict()
        )
        p99 = SortedLatencies(ttft).quantile_interval(0.99, ALPHA)
        assert a["p99_ttft_ms"] == pytest.approx(p99.as_dict())
        if v == control:
            assert a["vs_control"] is None
            continue
        vs = a["vs_control"]
        want = difference_interval(
            MeanSequence(n=c_n, hits=c_hits, alpha=ALPHA), MeanSequence(n=n, hits=hits, alpha=ALPHA), ALPHA
        )
        assert vs["attainment_difference"] == pytest.approx(want.as_dict())
        want = difference_interval(
            MeanSequence(n=c_n, hits=c_err, alpha=ALPHA), MeanSequence(n=n, hits=errors, alpha=ALPHA), ALPHA
        )
        assert vs["error_rate_difference"] == pytest.approx(want.as_dict())
        want = quantile_difference_interval(
            SortedLatencies(c_ttft).quantile_interval(0.99, ALPHA / 2),
            SortedLatencies(ttft).quantile_interval(0.99, ALPHA / 2),
        )
        assert vs["p99_ttft_difference"] == pytest.approx(want.as_dict())


def test_anytime_intervals_are_wider_than_the_fixed_horizon_ones_beside_them(split_report):
    for entry in split_report["variants"]:
        fixed, seq = entry["attainment"], split_report["anytime"]["variants"][entry["key"]]["attainment"]
        assert seq["lo"] < fixed["lo"] <= fixed["estimate"] <= fixed["hi"] < seq["hi"]
        p99 = next(x for x in entry["percentiles"]["ttft_ms"] if x["label"] == "p99")
        s99 = split_report["anytime"]["variants"][entry["key"]]["p99_ttft_ms"]
        assert s99["estimate"] == p99["value"]
        assert s99["lo"] <= p99["lo"] and p99["hi"] <= s99["hi"]
        if entry["vs_control"]:
            fd = entry["vs_control"]["attainment_difference"]
            sd = split_report["anytime"]["variants"][entry["key"]]["vs_control"]["attainment_difference"]
            assert sd["estimate"] == pytest.approx(fd["estimate"])
            assert sd["hi"] - sd["lo"] > fd["hi"] - fd["lo"]


def test_the_sequential_srm_reads_the_same_users_as_the_fixed_horizon_test(split_report):
    fixed, seq = split_report["srm"], split_report["anytime"]["srm"]
    assert fixed["applicable"] and seq["applicable"]
    assert [p["revision"] for p in seq["revisions"]] == ["101", "102"]
    # the synthetic split follows its weights: neither test flags it
    assert not fixed["flagged"] and not seq["flagged"] and seq["message"] == ""
    assert 0.0 < seq["p_value"] <= 1.0


def test_mirror_mode_has_no_srm_but_has_the_sequences(backend):
    rep = r.build_report(backend, info(mirror_spec()), q.Filters("ttft-mirror"))
    assert rep["anytime"]["srm"] == {"applicable": False}
    vs = [e["vs_control"] for e in rep["anytime"]["variants"].values() if e["vs_control"]]
    assert vs and all(x["attainment_difference"]["lo"] is not None for x in vs)


# --- the pure module at its edges ---------------------------------------------------------------

SUMM = {
    "c": {"n": 400, "hits": 396, "errors": 2, "metric_n": {"ttft_ms": 398}},
    "v": {"n": 400, "hits": 360, "errors": 9, "metric_n": {"ttft_ms": 391}},
}


def _order_stats(n, seed):
    values = np.sort(np.random.default_rng(seed).gamma(4.0, 25.0, n))
    return {rank: float(values[rank - 1]) for rank in range(1, n + 1)}


def test_a_variant_without_samples_and_a_missing_control_render_as_none():
    summ = {"v": SUMM["v"]}
    out = anytime.anytime_intervals(summ, ["c", "v", "w"], "c", {"v": _order_stats(391, 1)}, ALPHA)
    assert out["c"] == {
        "n": 0,
        "attainment": None,
        "error_rate": None,
        "p99_ttft_ms": None,
        "vs_control": None,
    }
    assert out["w"]["attainment"] is None
    assert out["v"]["attainment"]["estimate"] == pytest.approx(360 / 400)
    assert out["v"]["vs_control"] is None  # no control samples: nothing to compare with


def test_an_arm_whose_every_request_failed_has_shares_but_no_p99():
    summ = {"c": SUMM["c"], "v": {"n": 50, "hits": 0, "errors": 50, "metric_n": {"ttft_ms": 0}}}
    out = anytime.anytime_intervals(summ, ["c", "v"], "c", {"c": _order_stats(398, 2)}, ALPHA)
    assert out["v"]["p99_ttft_ms"] is None and out["v"]["vs_control"]["p99_ttft_difference"] is None
    assert out["v"]["error_rate"]["estimate"] == 1.0
    d = out["v"]["vs_control"]["error_rate_difference"]
    assert d["lo"] > 0  # 50 of 50 failed against 2 of 400: a breach visible at this look


def test_few_samples_leave_the_p99_sequence_open_on_top():
    summ = {"c": {"n": 30, "hits": 30, "errors": 0, "metric_n": {"ttft_ms": 30}}}
    out = anytime.anytime_intervals(summ, ["c"], "c", {"c": _order_stats(30, 3)}, ALPHA)
    assert out["c"]["p99_ttft_ms"]["hi"] is None  # +inf: 30 samples cannot bound a p99 from above


def test_p99_ranks_fetch_only_ranks_inside_the_sample():
    assert anytime.p99_ranks(0, ALPHA) == set()
    for n in (1, 10, 100, 10_000):
        ranks = anytime.p99_ranks(n, ALPHA)
        assert all(1 <= k <= n for k in ranks)
    assert len(anytime.p99_ranks(10_000, ALPHA)) == 4  # lo and hi at alpha and at alpha/2


def test_srm_flags_a_broken_split_and_multiplies_revisions():
    fine = anytime.anytime_srm([("1", {"c": 5_020, "v": 4_980}, {"c": 0.5, "v": 0.5})], ALPHA)
    assert fine["applicable"] and not fine["flagged"]
    broken = anytime.anytime_srm([("1", {"c": 5_400, "v": 4_600}, {"c": 0.5, "v": 0.5})], ALPHA)
    assert broken["flagged"] and "split is broken" in broken["message"]
    want = SrmSequence(weights={"c": 0.5, "v": 0.5}, alpha=ALPHA).update({"c": 5_400, "v": 4_600})
    assert broken["log_e_value"] == pytest.approx(want.check().log_e_value)
    two = anytime.anytime_srm(
        [
            ("1", {"c": 5_400, "v": 4_600}, {"c": 0.5, "v": 0.5}),
            ("2", {"c": 900, "v": 100}, {"c": 0.9, "v": 0.1}),
        ],
        ALPHA,
    )
    parts = [p["log_e_value"] for p in two["revisions"]]
    assert two["log_e_value"] == pytest.approx(sum(parts))


def test_srm_with_traffic_on_a_weight_zero_arm_is_certain():
    out = anytime.anytime_srm([("3", {"c": 100, "v": 1}, {"c": 1.0, "v": 0.0})], ALPHA)
    assert out["flagged"] and out["p_value"] == 0.0 and out["log_e_value"] is None


def test_srm_without_parts_is_not_applicable():
    assert anytime.anytime_srm([], ALPHA)["applicable"] is False
