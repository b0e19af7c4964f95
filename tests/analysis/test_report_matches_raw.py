# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The report's numbers equal an independent numpy computation over the raw synthetic samples,
on chDB and on the ClickHouse server (duplicated, older recordings inserted, then removed by
SampleStore.deduplicate as a finished replay does)."""

from __future__ import annotations

import datetime as dt
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis import definitions as q
from analysis import report as r
from analysis.definitions import PROMPT_TOKEN_EDGES
from analysis.segments import bucket_index, bucket_labels
from stats.comparisons import attainment_difference, holm_adjust, quantile_difference
from stats.paired import mcnemar_attainment, wilcoxon_paired
from stats.proportions import wilson_interval
from stats.quantiles import REPORT_QUANTILES, quantile_ci_ranks
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


def _raw(data, variant=None):
    cols = data.latest()
    keep = np.ones(cols["variant"].size, dtype=bool)
    if variant is not None:
        keep &= cols["variant"] == variant
    return {k: v[keep] for k, v in cols.items()}


def _hits(c, slo=SLO):
    ok = c["outcome"] == "ok"
    with np.errstate(invalid="ignore"):
        hit = ok & (c["ttft_ms"] < slo.ttft_ms)
        if slo.tpot_ms is not None:
            hit &= c["tpot_ms"] < slo.tpot_ms
        if slo.e2e_ms is not None:
            hit &= c["e2e_ms"] < slo.e2e_ms
    return hit


def _round(x):
    return np.floor(x * 10 + 0.5) / 10


def _ok_metric(c, column):
    if column in q.GAP_METRICS.values():  # every gap of every successful request, in ms
        gaps = c[column][c["outcome"] == "ok"]
        return np.sort(np.concatenate([np.zeros(0, np.uint32), *gaps]).astype(np.float64) / 1000.0)
    v = c[column][(c["outcome"] == "ok") & ~np.isnan(c[column])]
    return np.sort(v)


@pytest.fixture
def split_report(backend):
    return r.build_report(backend, info(split_spec()), q.Filters("ttft-opt"))


def test_counts_errors_and_attainment_match_raw_samples(split_report, split_data):
    for entry in split_report["variants"]:
        c = _raw(split_data, entry["key"])
        n, hits = c["variant"].size, int(_hits(c).sum())
        errors = int((c["outcome"] != "ok").sum())
        assert (entry["n"], entry["hits"], entry["errors"]) == (n, hits, errors)
        assert entry["error_rate"] == pytest.approx(errors / n)
        ci = wilson_interval(hits, n)
        assert entry["attainment"] == pytest.approx(ci.as_dict())
        window = split_data.latest()["sent_unix_ms"].max() - split_data.latest()["sent_unix_ms"].min()
        assert entry["goodput_rps"] == pytest.approx(hits / (window / 1000.0))


def test_duplicate_older_recordings_are_gone_after_deduplicate(split_report, split_data, backend):
    assert split_data.is_duplicate.sum() > 100
    assert backend.query("SELECT count() FROM samples WHERE run_id = 11") == [(split_data.spec.n,)]
    total = sum(e["n"] for e in split_report["variants"])
    assert total == split_data.spec.n
    for e in split_report["variants"]:
        assert e["percentiles"]["ttft_ms"][-1]["value"] < 99_999.0


@pytest.mark.parametrize("metric", list(q.METRICS))
def test_percentiles_are_exact_order_statistics_with_their_ci(split_report, split_data, metric):
    column = q.METRICS[metric]
    for entry in split_report["variants"]:
        arr = _ok_metric(_raw(split_data, entry["key"]), column)
        for got, quant in zip(entry["percentiles"][metric], REPORT_QUANTILES, strict=True):
            rank = math.ceil(round(quant * arr.size, 9))
            assert got["value"] == arr[rank - 1], (entry["key"], metric, quant)
            assert got["value"] == np.quantile(arr, quant, method="inverted_cdf")
            lo, hi = quantile_ci_ranks(arr.size, quant)
            assert (got["lo"], got["hi"]) == (arr[lo - 1], arr[hi - 1])
            assert got["n"] == arr.size


def test_comparisons_against_control_match_scipy(split_report, split_data):
    ctrl = _raw(split_data, "fp16")
    c_ttft = _ok_metric(ctrl, "ttft_ms")
    holm_in = {}
    for entry in split_report["variants"]:
        if entry["control"]:
            assert entry["vs_control"] is None
            continue
        v = _raw(split_data, entry["key"])
        vs = entry["vs_control"]
        diff = attainment_difference(
            int(_hits(ctrl).sum()), ctrl["variant"].size, int(_hits(v).sum()), v["variant"].size
        )
        assert vs["attainment_difference"] == pytest.approx(diff.as_dict())
        holm_in[entry["key"]] = diff.p_value
        v_ttft = _ok_metric(v, "ttft_ms")
        p99 = quantile_difference(c_ttft, v_ttft, 0.99)
        assert vs["p99_ttft_difference"] == pytest.approx(p99.as_dict())
        assert vs["p99_ttft_difference"]["hi"] < 0  # the variants are faster by construction
        mw = sps.mannwhitneyu(_round(v_ttft), _round(c_ttft), method="asymptotic")
        assert vs["mann_whitney_ttft"]["statistic"] == pytest.approx(mw.statistic)
        assert vs["mann_whitney_ttft"]["p_value"] == pytest.approx(mw.pvalue, abs=1e-12)
    holm = holm_adjust(holm_in)
    for entry in split_report["variants"][1:]:
        assert entry["vs_control"]["attainment_p_holm"] == pytest.approx(holm[entry["key"]])


def test_srm_is_tested_per_config_revision_against_weights(split_report, split_data):
    c = split_data.latest()
    srm = split_report["srm"]
    assert srm["applicable"] and not srm["flagged"]
    assert [p["revision"] for p in srm["revisions"]] == ["101", "102"]
    for part in srm["revisions"]:
        sel = c["config_revision"] == int(part["revision"])
        # distinct users, the unit of assignment
        observed = [
            len(set(c["user_id"][sel & (c["variant"] == k)].tolist())) for k in ("fp16", "awq", "awq-fa2")
        ]
        assert [part["observed"][k] for k in ("fp16", "awq", "awq-fa2")] == observed
        chi2, p = sps.chisquare(observed, np.array([34, 33, 33]) / 100 * sum(observed))
        assert part["chi2"] == pytest.approx(chi2)
        assert part["p_value"] == pytest.approx(p)


def test_srm_flags_weights_that_do_not_match_the_traffic_and_leads_the_banners(backend):
    skewed = info(split_spec(), weights_by_revision={102: {"fp16": 60, "awq": 20, "awq-fa2": 20}})
    rep = r.build_report(backend, skewed, q.Filters("ttft-opt"))
    assert rep["srm"]["flagged"]
    assert rep["banners"][0] == rep["srm"]["message"]
    assert "revision 102" in rep["srm"]["message"]


def test_segments_and_phases_match_raw_sums(split_report, split_data):
    c = split_data.latest()
    hit = _hits(c)
    pb = bucket_index(c["prompt_tokens"], PROMPT_TOKEN_EDGES)
    labels = bucket_labels(PROMPT_TOKEN_EDGES)
    for v in ("fp16", "awq"):
        segs = split_report["segments"]["prompt_tokens"]["variants"][v]
        for i, lab in enumerate(labels):
            sel = (c["variant"] == v) & (pb == i)
            assert (segs[lab]["n"], segs[lab]["hits"]) == (int(sel.sum()), int(hit[sel].sum()))
        miss = (c["variant"] == v) & ~hit & ~np.isnan(c["ttft_ms"])
        connect = np.nan_to_num(c["connect_ms"][miss])
        expected = {
            "schedule_lag": c["schedule_lag_ms"][miss].sum(),
            "gateway": c["gateway_ms"][miss].sum(),  # 0: a replay's samples
            "connect": connect.sum(),
            "headers": (c["ttfb_ms"][miss] - connect).sum(),
            "headers_to_first_event": (c["ttft_event_ms"][miss] - c["ttfb_ms"][miss]).sum(),
            "first_event_to_first_content": (c["ttft_ms"][miss] - c["ttft_event_ms"][miss]).sum(),
        }
        got = split_report["phases"][v]
        assert got["n"] == int(miss.sum())
        for phase, total in expected.items():
            assert got["phases"][phase]["mean_ms"] == pytest.approx(total / miss.sum(), rel=1e-9)
    # mix vs rate: the variants got the same traffic mix, so the rate part dominates
    assert split_report["mix_rate"]["awq"]["prompt_tokens"]["dominant"] == "rate"


def test_factor_attribution_recovers_the_known_effects(split_report):
    att = split_report["attribution"]
    both = att["attainment"]["awq-fa2"]
    # quantization (x0.8 TTFT) is a bigger lever than attention (x0.85): larger share, both gains
    assert both["contributions"]["quantization"] > both["contributions"]["attention"] > 0
    p99 = att["p99_ttft_ms"]["awq-fa2"]
    fp16 = split_report["variants"][0]["percentiles"]["ttft_ms"][2]["value"]
    # multiplicative truth: awq takes 20% off p99, fa2 15% of what is left (0.12 of fp16);
    # tolerances cover the sampling noise of a p99 over ~10k requests per arm
    assert -0.25 * fp16 < p99["contributions"]["quantization"] < -0.15 * fp16
    assert -0.19 * fp16 < p99["contributions"]["attention"] < -0.05 * fp16
    assert sum(p99["contributions"].values()) == pytest.approx(p99["total"])
    assert "of the gain" in p99["text"]


def test_cdf_and_time_series_come_from_the_samples(split_report, split_data):
    for v in ("fp16", "awq-fa2"):
        arr = _ok_metric(_raw(split_data, v), "ttft_ms")
        cdf = split_report["cdf"][v]
        assert 300 < len(cdf["ttft_ms"]) == len(cdf["share"]) < 500
        # every point is exactly on the empirical CDF: x a sample value, y the share <= x
        xs = np.asarray(cdf["ttft_ms"])
        assert np.isin(xs, arr).all() and (np.diff(xs) > 0).all()
        assert cdf["share"] == (np.searchsorted(arr, xs, side="right") / arr.size).tolist()
        # ~evenly spaced in probability: the point for a level is the first to reach it
        for level in (0.5, 0.9, 0.999):
            i = next(i for i, y in enumerate(cdf["share"]) if y >= level)
            assert cdf["share"][i] - level < 0.01
        points = split_report["timeseries"]["p99_ttft_ms"][v]
        assert sum(p["n"] for p in points) == arr.size
    markers = split_report["timeseries"]["markers"]
    assert [m["label"] for m in markers] == ["config revision 102"]


def test_filters_restrict_run_time_and_variants(backend, split_data):
    c = split_data.latest()
    t0 = dt.datetime.fromtimestamp(int(c["sent_at"].min()) + 600, dt.UTC)
    t1 = t0 + dt.timedelta(seconds=300)
    f = q.Filters("ttft-opt", run_id=11, since=t0, until=t1, variants=("awq",))
    rep = r.build_report(backend, info(split_spec()), f)
    assert [e["key"] for e in rep["variants"]] == ["fp16", "awq"]  # control always read
    sel = (c["sent_at"] >= t0.timestamp()) & (c["sent_at"] < t1.timestamp())
    for e in rep["variants"]:
        assert e["n"] == int((sel & (c["variant"] == e["key"])).sum())
    assert rep["window"]["seconds"] == 300
    empty = r.build_report(backend, info(split_spec()), q.Filters("ttft-opt", run_id=999))
    assert all(e["n"] == 0 for e in empty["variants"])
    assert empty["variants"][0]["verdict"]["verdict"] == "not enough data"


def test_extra_slos_count_as_misses(backend, split_data):
    slo = q.Slo(200.0, tpot_ms=13.0, e2e_ms=2500.0)
    rep = r.build_report(backend, info(split_spec(), slo=slo), q.Filters("ttft-opt"))
    for e in rep["variants"]:
        assert e["hits"] == int(_hits(_raw(split_data, e["key"]), slo).sum())


def test_mirror_mode_pairs_requests_by_seq(backend, mirror_data):
    rep = r.build_report(backend, info(mirror_spec()), q.Filters("ttft-mirror"))
    assert rep["srm"]["applicable"] is False
    c = mirror_data.latest()
    order = np.lexsort((c["seq"], c["variant"]))
    by = {v: {k: a[order][c["variant"][order] == v] for k, a in c.items()} for v in ("fp16", "awq")}
    ctrl, var = by["fp16"], by["awq"]
    assert (ctrl["seq"] == var["seq"]).all()
    hc, hv = _hits(ctrl), _hits(var)
    paired = rep["variants"][1]["vs_control"]["paired"]
    expected = mcnemar_attainment(
        int((hc & hv).sum()), int((hc & ~hv).sum()), int((~hc & hv).sum()), int((~hc & ~hv).sum())
    )
    want = expected.as_dict()
    assert paired["attainment"]["difference"] == pytest.approx(want.pop("difference"))
    assert {k: paired["attainment"][k] for k in want} == pytest.approx(want)
    both = (ctrl["outcome"] == "ok") & (var["outcome"] == "ok")
    d = _round(var["ttft_ms"][both] - ctrl["ttft_ms"][both])
    assert paired["wilcoxon_ttft"]["n_pairs"] == int(both.sum())
    assert paired["wilcoxon_ttft"]["p_value"] == pytest.approx(wilcoxon_paired(d).p_value)
    assert paired["wilcoxon_ttft"]["median_difference"] < 0


def test_report_is_strict_json_with_a_schema_version(split_report):
    text = json.dumps(split_report, allow_nan=False)
    assert json.loads(text)["schema_version"] == r.SCHEMA_VERSION
    assert len(text) < 400_000


def test_srm_counts_users_not_requests_so_heavy_users_do_not_fire_it(backend):
    """Sticky users with skewed volumes: one heavy user sends half of all requests to its one
    variant. Request counts are far from the weights; distinct users are not."""
    import uuid

    from samples.rows import SampleContext, row_from
    from streaming.result import StreamResult

    run_id = 900_000 + uuid.uuid4().int % 1000
    rows = []
    seq = 0
    for i in range(3000):
        variant = ("fp16", "awq", "awq-fa2")[i % 3]  # users split evenly: no mismatch by users
        for _ in range(300 if i == 0 else 1):  # user 0 is heavy
            rows.append(
                row_from(
                    StreamResult(ttft_ms=50.0),
                    SampleContext(
                        experiment="srm-users",
                        run_id=run_id,
                        seq=seq,
                        variant=variant,
                        mode="split",
                        sent_unix_ms=1.7e12 + seq,
                        user_id=f"user-{i}",
                        config_revision=5,
                    ),
                )
            )
            seq += 1
    backend.insert_samples(rows)
    exp = r.ExperimentInfo(
        key="srm-users",
        name="x",
        slo=q.Slo(ttft_ms=200.0),
        target=0.99,
        variants=[
            r.VariantInfo("fp16", True, 34, {}),
            r.VariantInfo("awq", False, 33, {}),
            r.VariantInfo("awq-fa2", False, 33, {}),
        ],
    )
    rep = r.build_report(backend, exp, q.Filters("srm-users"))
    assert rep["srm"]["applicable"] and not rep["srm"]["flagged"]
    assert rep["srm"]["revisions"][0]["observed"] == {"fp16": 1000, "awq": 1000, "awq-fa2": 1000}
    requests_fp16 = next(v["n"] for v in rep["variants"] if v["key"] == "fp16")
    assert requests_fp16 == 1299  # the requests themselves are lopsided
