# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The report's itl_ms is the ITL distribution over every inter-token gap of every
successful request (as vLLM's benchmark_serving pools them), with exact nearest-rank percentiles
and order-statistic CIs, on chDB and on the ClickHouse server, from the raw samples and from the
rollup alike. Rows recorded before the samples kept gaps read as requests without gaps, counted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from analysis import rollup
from analysis.readers.merged import MergedReader, Scope
from dashboards.management.commands.sla_report import render_text
from samples import synthetic
from samples.store import SampleStore
from stats.quantiles import REPORT_QUANTILES, quantile_ci_ranks
from tests.analysis.fixtures_report import SLO, assert_same, drop_stores, info, load_stores

pytestmark = pytest.mark.services

SPEC = synthetic.SyntheticSpec(
    experiment="itl-exp",
    run_id=21,
    n=5_000,
    seed=21,
    variants=synthetic.demo_variants(),
    factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
    duration_s=600.0,
)
OLD_RUN = 22  # recorded before samples kept gaps
STALLED_GAP_US = 60_000_000  # 60 s: the gaps of failed requests, which ITL must not pool


def _with_gaps() -> synthetic.Synthetic:
    """Run 21: every failed request keeps the gaps it streamed before it failed (60 s each: a
    stall), and every 50th successful request had one token (no gap, no per-request ITL)."""
    data = synthetic.generate(SPEC)
    cols = data.columns
    failed = np.flatnonzero(cols["outcome"] != "ok")
    for i in failed:
        cols["itl_gaps_us"][i] = np.full(5, STALLED_GAP_US, dtype=np.uint32)
    one_token = np.flatnonzero(cols["outcome"] == "ok")[::50]
    for i in one_token:
        cols["itl_gaps_us"][i] = np.zeros(0, dtype=np.uint32)
    cols["output_tokens"][one_token] = 1
    for name in ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "tpot_ms"):
        cols[name][one_token] = np.nan
    assert failed.size > 20 and one_token.size > 20
    return data


def _old_rows() -> synthetic.Synthetic:
    return synthetic.generate(dataclasses.replace(SPEC, run_id=OLD_RUN, n=1_500, seed=22, gaps=False))


@pytest.fixture(scope="module")
def datasets() -> tuple[synthetic.Synthetic, synthetic.Synthetic]:
    return _with_gaps(), _old_rows()


@pytest.fixture(scope="module")
def stores(chdb_dir: str, clickhouse_server: str, datasets) -> Iterator[dict[str, SampleStore]]:
    out = load_stores(chdb_dir, "abplat_test_itl", datasets)
    for store in out.values():
        for run in (SPEC.run_id, OLD_RUN):
            assert rollup.build_run_rollup(store, SPEC.experiment, run, SLO) is not None
    yield out
    drop_stores(out)


@pytest.fixture(params=["chdb", "server"])
def store(request: pytest.FixtureRequest, stores) -> SampleStore:
    return stores[request.param]


def _pooled(datasets, variant: str) -> np.ndarray:
    """numpy's answer: every gap of every successful request of the variant, in ms, sorted."""
    parts = [np.zeros(0)]
    for data in datasets:
        c = data.latest()
        keep = (c["variant"] == variant) & (c["outcome"] == "ok")
        parts += [g.astype(np.float64) / 1000.0 for g in c["itl_gaps_us"][keep]]
    return np.sort(np.concatenate(parts))


@pytest.mark.parametrize("use_rollup", [False, True], ids=["raw", "rollup"])
def test_itl_percentiles_are_exact_order_statistics_of_every_gap_of_successful_requests(
    store, datasets, use_rollup
):
    rep = r.build_report(store, info(SPEC), q.Filters(SPEC.experiment), use_rollup=use_rollup)
    assert rep["timing"]["source"] == ("rollup" if use_rollup else "samples")
    for entry in rep["variants"]:
        gaps = _pooled(datasets, entry["key"])
        assert gaps.size > 100_000 and gaps.max() < STALLED_GAP_US / 1000  # the stalls are not pooled
        for got, quant in zip(entry["percentiles"]["itl_ms"], REPORT_QUANTILES, strict=True):
            assert got["n"] == gaps.size
            assert got["value"] == np.quantile(gaps, quant, method="inverted_cdf"), (entry["key"], quant)
            lo, hi = quantile_ci_ranks(gaps.size, quant)
            assert (got["lo"], got["hi"]) == (gaps[lo - 1], gaps[hi - 1])
            assert "independent draws, which they are not within one request" in got["note"]


def test_pooling_the_failed_requests_gaps_would_have_changed_the_tail(datasets):
    # the check above has teeth: the stalled requests' gaps are in the samples, and p99.9 with them
    # is another number
    data, _old = datasets
    c = data.latest()
    fp16 = c["variant"] == "fp16"
    every = np.sort(np.concatenate([g.astype(np.float64) for g in c["itl_gaps_us"][fp16]]) / 1000.0)
    ok_only = _pooled(datasets, "fp16")
    assert np.quantile(every, 0.999, method="inverted_cdf") != np.quantile(
        ok_only, 0.999, method="inverted_cdf"
    )


def test_itl_is_not_tpot_again(store, datasets):
    rep = r.build_report(store, info(SPEC), q.Filters(SPEC.experiment))
    for entry in rep["variants"]:
        itl = {e["label"]: e for e in entry["percentiles"]["itl_ms"]}
        tpot = {e["label"]: e for e in entry["percentiles"]["tpot_ms"]}
        assert tpot["p50"]["n"] < itl["p50"]["n"] / 50  # one TPOT per request, one ITL per gap
        assert itl["p99"]["value"] > 1.5 * tpot["p99"]["value"]  # the spikes inside requests
        assert "independent" not in tpot["p99"]["note"]


def test_the_report_counts_the_requests_without_gaps_and_the_rows_recorded_before_them(store, datasets):
    rep = r.build_report(store, info(SPEC), q.Filters(SPEC.experiment))
    raw = r.build_report(store, info(SPEC), q.Filters(SPEC.experiment), use_rollup=False)
    assert rep["timing"]["source"] == "rollup"
    for entry, raw_entry in zip(rep["variants"], raw["variants"], strict=True):
        v = entry["key"]
        new, old = (d.latest() for d in datasets)
        ok_new = (new["variant"] == v) & (new["outcome"] == "ok")
        ok_old = (old["variant"] == v) & (old["outcome"] == "ok")
        lengths = np.array([len(g) for g in new["itl_gaps_us"][ok_new]])
        assert (
            entry["itl"]
            == raw_entry["itl"]
            == {
                "gaps": int(lengths.sum()),
                "requests": int((lengths > 0).sum()),
                "requests_without_gaps": int((lengths == 0).sum() + ok_old.sum()),
                "unrecorded": int(ok_old.sum()),  # old rows: a per-request ITL, no gaps
                "note": q.ITL_CI_NOTE,
            }
        )
        assert 0 < entry["itl"]["unrecorded"] < entry["itl"]["requests_without_gaps"]
    text = render_text(rep)
    assert "ITL (all gaps)" in text and "recorded before gaps were stored" in text


@pytest.mark.parametrize("use_rollup", [False, True], ids=["raw", "rollup"])
def test_a_run_recorded_before_gaps_reads_as_no_gaps_and_never_crashes(store, use_rollup):
    f = q.Filters(SPEC.experiment, run_id=OLD_RUN)
    rep = r.build_report(store, info(SPEC), f, use_rollup=use_rollup)
    assert rep["timing"]["source"] == ("rollup" if use_rollup else "samples")
    for entry in rep["variants"]:
        assert entry["n"] > 0 and entry["percentiles"]["tpot_ms"][0]["value"] is not None
        assert [e["value"] for e in entry["percentiles"]["itl_ms"]] == [None] * len(REPORT_QUANTILES)
        assert all(e["n"] == 0 for e in entry["percentiles"]["itl_ms"])
        ok = entry["n"] - entry["errors"]
        assert entry["itl"]["gaps"] == entry["itl"]["requests"] == 0
        assert entry["itl"]["requests_without_gaps"] == entry["itl"]["unrecorded"] == ok
    assert "recorded before gaps were stored" in render_text(rep)


def test_rollup_and_raw_reports_agree_with_old_and_new_runs_together(store):
    # the rolled-up run with gaps, the old run read raw beside it (as if still replaying): the
    # rollup part's gap values and the raw part's add up to the raw report's exact ranks
    f = q.Filters(SPEC.experiment)
    full = r.build_report(store, info(SPEC), f)
    raw = r.build_report(store, info(SPEC), f, use_rollup=False)
    assert_same(raw, full)
    for rolled, live in ((SPEC.run_id, OLD_RUN), (OLD_RUN, SPEC.run_id)):
        scope = Scope({rolled: rollup_build(store, rolled)}, (live,))
        mixed = r.build_report(store, info(SPEC), f, reader=MergedReader(store, scope))
        assert mixed["timing"]["source"] == "rollup+samples"
        assert_same(raw, mixed)


def rollup_build(store: SampleStore, run_id: int) -> int:
    rows = store.query(
        "SELECT build_id FROM rollup_builds FINAL WHERE experiment = %(e)s AND run_id = %(r)s",
        {"e": SPEC.experiment, "r": run_id},
    )
    assert len(rows) == 1
    return int(rows[0][0])


def test_the_rollup_keeps_distinct_gap_values_not_a_row_per_gap(store, datasets):
    data, _old = datasets
    c = data.latest()
    gaps = sum(len(g) for g in c["itl_gaps_us"][c["outcome"] == "ok"])
    counts = rollup.rollup_rows(store, SPEC.experiment)
    assert 0 < counts["rollup_gaps"] < gaps / 5
    (total,) = store.query(
        "SELECT sum(n) FROM rollup_gaps WHERE build_id = %(b)s", {"b": rollup_build(store, SPEC.run_id)}
    )[0]
    assert total == gaps
