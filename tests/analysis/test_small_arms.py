"""Reports and statistics with arms of 0 or 1 samples, or without a single success:
every statistic either answers or says it cannot, and the report assembles in every case."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from samples import synthetic


def _rows(mode: str, n: int, *, seed: int = 3, run_id: int = 5, experiment: str = "small") -> dict:
    spec = synthetic.SyntheticSpec(
        experiment=experiment,
        mode=mode,
        n=n,
        seed=seed,
        run_id=run_id,
        variants=synthetic.demo_variants(),
        duration_s=60.0,
    )
    return synthetic.generate(spec).columns


def fail_variant(cols: dict, variant: str, outcome: str = "connect_error", status: int = 0) -> dict:
    """The columns with every row of ``variant`` a failure of that class (no latency at all)."""
    out = {k: v.copy() for k, v in cols.items()}
    pick = out["variant"] == variant
    out["outcome"][pick] = outcome
    out["http_status"][pick] = status
    out["error"][pick] = f"{outcome}: synthetic"
    for c in (
        "connect_ms",
        "ttfb_ms",
        "first_byte_ms",
        "ttft_event_ms",
        "ttft_ms",
        "itl_mean_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "itl_max_ms",
        "tpot_ms",
        "e2e_ms",
    ):
        out[c] = out[c].astype(float)
        out[c][pick] = np.nan
    out["output_tokens"][pick] = 0
    return out


@pytest.fixture
def chdb_store(shared_store):
    return shared_store("chdb")  # the session's migrated chDB database, empty (tests/sample_dbs.py)


def info(experiment: str = "small") -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=experiment,
        name=experiment,
        slo=q.Slo(200.0),
        target=0.9,
        variants=[
            r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in synthetic.demo_variants()
        ],
    )


def test_mirror_report_with_a_variant_that_never_succeeds(chdb_store):
    # np.repeat over empty float counts raised TypeError in the paired comparison
    chdb_store.insert_columns(fail_variant(_rows("mirror", 20), "awq"))
    rep = r.build_report(chdb_store, info(), q.Filters("small"))
    awq = next(v for v in rep["variants"] if v["key"] == "awq")
    assert (awq["n"], awq["errors"], awq["hits"]) == (20, 20, 0)
    assert awq["attainment"]["estimate"] == 0.0
    paired = awq["vs_control"]["paired"]
    assert paired["attainment"]["n_pairs"] == 20 and paired["wilcoxon_ttft"] is None


# ---- the class of the bug: every statistic at n = 0 and n = 1 per arm ------------------------
# A statistic answers with finite numbers (or None where it cannot estimate), or raises a
# ValueError saying why; never a TypeError, a ZeroDivisionError or a NaN.

from analysis import phases, segments  # noqa: E402
from stats import comparisons as cmp  # noqa: E402
from stats import paired, proportions, quantiles, srm, verdict  # noqa: E402

ZERO_SUMS = dict.fromkeys(("schedule_lag", "gateway", "connect", "ttfb", "ttft_event", "ttft"), 0.0)
CASES = {
    "attainment_difference 1 v 1": lambda: cmp.attainment_difference(1, 1, 0, 1),
    "attainment_difference 0 v 1": lambda: cmp.attainment_difference(0, 0, 0, 1),
    "compare_attainment no others": lambda: cmp.compare_attainment(cmp.ArmCounts(1, 1), {}),
    "mann_whitney 1 v 1": lambda: cmp.mann_whitney([1.0], [2.0]),
    "mann_whitney 0 v 1": lambda: cmp.mann_whitney([], [2.0]),
    "mann_whitney_from_counts 1 v 1 tied": lambda: cmp.mann_whitney_from_counts([1.0], [1], [1]),
    "mann_whitney_from_counts 0 v 0": lambda: cmp.mann_whitney_from_counts([], [], []),
    "quantile_difference 1 v 1": lambda: cmp.quantile_difference([1.0], [2.0]),
    "quantile_difference 0 v 1": lambda: cmp.quantile_difference([], [2.0]),
    "holm_adjust none": lambda: cmp.holm_adjust({}),
    "mcnemar 1 pair": lambda: paired.mcnemar_attainment(0, 1, 0, 0),
    "mcnemar 0 pairs": lambda: paired.mcnemar_attainment(0, 0, 0, 0),
    "wilcoxon 1 pair": lambda: paired.wilcoxon_paired([1.5]),
    "wilcoxon 1 zero pair": lambda: paired.wilcoxon_paired([0.0]),
    "wilcoxon 0 pairs": lambda: paired.wilcoxon_paired(
        np.repeat(np.asarray([], float), np.asarray([], np.int64))
    ),
    "wilson 1": lambda: proportions.wilson_interval(0, 1),
    "wilson 0": lambda: proportions.wilson_interval(0, 0),
    "sla_attainment 1 failed": lambda: proportions.sla_attainment(1, 0, 1, 1.0),
    "sla_attainment 0": lambda: proportions.sla_attainment(0, 0, 0),
    "wilson_bounds none": lambda: proportions.wilson_bounds([], []),
    "quantile_estimate 0": lambda: quantiles.quantile_estimate([], 0.99),
    "quantile_estimate 1": lambda: quantiles.quantile_estimate([5.0], 0.99),
    "quantile_from_order_stats 0": lambda: quantiles.quantile_from_order_stats(0, 0.99, {}),
    "quantile_from_order_stats 1": lambda: quantiles.quantile_from_order_stats(1, 0.99, {1: 5.0}),
    "percentile_table 0": lambda: quantiles.percentile_table([]),
    "ranks_to_fetch 0": lambda: quantiles.ranks_to_fetch(0),
    "nearest_rank 0": lambda: quantiles.nearest_rank([], 0.5),
    "srm one user": lambda: srm.sample_ratio_mismatch([("1", {"a": 1, "b": 0}, {"a": 0.5, "b": 0.5})]),
    "srm no users": lambda: srm.sample_ratio_mismatch([("1", {"a": 0, "b": 0}, {"a": 0.5, "b": 0.5})]),
    "srm no revisions": lambda: srm.sample_ratio_mismatch([]),
    "verdict 0": lambda: verdict.sla_verdict(0, 0, 0.9),
    "verdict 1 miss": lambda: verdict.sla_verdict(0, 1, 0.9),
    "segment 0 and 1": lambda: segments.attainment_by_segment({"a": (0, 0), "b": (1, 1)}),
    "mix_rate 1 v 1": lambda: segments.mix_rate_decomposition({"a": (1, 1)}, {"a": (1, 0)}),
    "mix_rate 0 v 1": lambda: segments.mix_rate_decomposition({"a": (0, 0)}, {"a": (1, 1)}),
    "phases 0 misses": lambda: phases.phase_breakdown_from_sums(phases.phases_from_sums(ZERO_SUMS), 0),
}


def _as_json(x):
    if isinstance(x, list):
        return [_as_json(i) for i in x]
    return x.as_dict() if hasattr(x, "as_dict") else x


@pytest.mark.parametrize("name", list(CASES))
def test_every_statistic_handles_arms_of_zero_and_one(name):
    import json

    try:
        got = CASES[name]()
    except ValueError as e:
        assert str(e), name  # says why
        return
    json.dumps(_as_json(got), allow_nan=False, default=lambda a: a.tolist())  # finite or None


def test_report_with_one_sample_per_arm_and_an_absent_control(chdb_store):
    one = _rows("mirror", 1, experiment="small")
    one["outcome"][:] = "ok"
    chdb_store.insert_columns(one)
    rep = r.build_report(chdb_store, info(), q.Filters("small"))
    assert [v["n"] for v in rep["variants"]] == [1, 1, 1]
    assert rep["variants"][1]["vs_control"]["paired"]["attainment"]["n_pairs"] == 1
    no_control = r.build_report(chdb_store, info(), q.Filters("small", variants=("awq",)))
    assert no_control["variants"][0]["key"] == "fp16"  # always read
    cols = _rows("split", 30, run_id=6)
    keep = cols["variant"] != "fp16"
    chdb_store.insert_columns({k: v[keep] for k, v in cols.items()})
    rep = r.build_report(chdb_store, info(), q.Filters("small", run_id=6))
    assert rep["variants"][0]["n"] == 0 and all(v["vs_control"] is None for v in rep["variants"])
    assert rep["mix_rate"] == {} and rep["attribution"]["note"]
