"""The report's user-clustered, adjusted and anytime error rates when no request failed: never
a point (0.0000 [0.0000, 0.0000] claimed a certainty the data does not give), but the interval at
the requests' count the request-level one uses, computed here independently."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from samples import synthetic
from samples.store import SampleStore
from stats.comparisons import attainment_difference
from stats.proportions import wilson_interval
from stats.sequential.means import MeanSequence, difference_interval, mean_interval
from tests.analysis.fixtures_report import drop_stores, info, load_stores

pytestmark = pytest.mark.services

SPEC = synthetic.SyntheticSpec(
    experiment="no-errors",
    n=6_000,
    seed=12,
    run_id=41,
    variants=[
        synthetic.VariantSpec("base", 50, {"attention": "sdpa"}, error_rate=0.0, control=True),
        synthetic.VariantSpec("cand", 50, {"attention": "flash_attn_2"}, error_rate=0.0),
    ],
    duration_s=900.0,
    users=500,
    user_sigma=0.3,
)


@pytest.fixture(scope="module")
def data() -> synthetic.Synthetic:
    return synthetic.generate(SPEC)


@pytest.fixture(scope="module")
def stores(chdb_dir: str, clickhouse_server: str, data) -> Iterator[dict[str, SampleStore]]:
    out = load_stores(chdb_dir, "abplat_test_no_events", (data,))
    yield out
    drop_stores(out)


@pytest.fixture(params=["chdb", "server"])
def report(request: pytest.FixtureRequest, stores) -> dict:
    return r.build_report(stores[request.param], info(SPEC), q.Filters(SPEC.experiment), use_rollup=False)


def test_clustered_error_rates_without_errors_are_the_interval_at_n_not_a_point(report, data):
    cols = data.latest()
    n = {v: int((cols["variant"] == v).sum()) for v in ("base", "cand")}
    assert int((cols["outcome"] != "ok").sum()) == 0
    by_key = {e["key"]: e for e in report["variants"]}
    for v, k in n.items():
        fixed = by_key[v]["clustered"]["error_rate"]
        ref = wilson_interval(0, k)
        assert (fixed["estimate"], fixed["lo"], fixed["hi"]) == pytest.approx((0.0, 0.0, ref.hi), rel=1e-9)
        anytime = report["anytime"]["variants"][v]["clustered"]["error_rate"]
        ref_seq = mean_interval(0, k, report["anytime"]["alpha"])
        assert (anytime["lo"], anytime["hi"]) == pytest.approx((0.0, ref_seq.hi), rel=1e-9)
        assert anytime["hi"] > 0
    vs = by_key["cand"]["vs_control"]
    diff = vs["clustered"]["error_rate_difference"]
    ref_d = attainment_difference(0, n["base"], 0, n["cand"])
    assert (diff["lo"], diff["hi"]) == pytest.approx((ref_d.lo, ref_d.hi), rel=1e-9)
    assert diff["lo"] < 0 < diff["hi"] and diff["p_value"] == 1.0
    adjusted = vs["adjusted"]["error_rate_difference"]
    assert adjusted["lo"] <= diff["lo"] and adjusted["hi"] >= diff["hi"]
    seq = report["anytime"]["variants"]["cand"]["vs_control"]["clustered"]["error_rate_difference"]
    alpha = report["anytime"]["alpha"]
    ref_sd = difference_interval(MeanSequence(n["base"], 0), MeanSequence(n["cand"], 0), alpha)
    assert (seq["lo"], seq["hi"]) == pytest.approx((ref_sd.lo, ref_sd.hi), rel=1e-9)
    adj_seq = report["anytime"]["variants"]["cand"]["vs_control"]["adjusted"]["error_rate_difference"]
    assert adj_seq["lo"] <= seq["lo"] < 0 < seq["hi"] <= adj_seq["hi"]
    assert np.isfinite([adj_seq["lo"], adj_seq["hi"]]).all()
