# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The report's statistics at the unit of randomization (analysis.units), on chDB and on the
ClickHouse server: the clustered numbers equal stats.clustered and the adjusted differences
stats.adjusted computed on the raw samples pulled from the store, from the raw samples and from
the rollups alike; users who send many correlated requests widen the intervals; requests without
a user are units of their own; the experiment's switch off leaves the request-level report."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import pytest
from scipy import optimize

from analysis import definitions as q
from analysis import report as r
from analysis import rollup, units
from analysis.readers.raw import RawReader
from samples import synthetic
from samples.store import SampleStore
from stats.adjusted import ArmData, adjusted_difference
from stats.clustered import ClusterSums, clustered_difference, clustered_mean
from tests.analysis.fixtures_report import (  # noqa: F401 - fixtures
    SLO,
    assert_same,
    drop_stores,
    info,
    load_stores,
)

pytestmark = pytest.mark.services

COVARIATES = ("prompt_tokens", "max_tokens")
RUN, LIVE_RUN = 31, 32


def users_spec() -> synthetic.SyntheticSpec:
    """Users who send many requests (heavy-tailed), each with their own TTFT factor; a tenth of
    the requests without a user; requested output tokens that vary."""
    return synthetic.SyntheticSpec(
        experiment="ttft-users",
        n=8_000,
        seed=21,
        run_id=RUN,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duplicate_rate=0.01,
        duration_s=1200.0,
        users=400,
        user_sigma=0.6,
        no_user_share=0.1,
        max_tokens=(128, 256, 512, 1024),
    )


def live_spec() -> synthetic.SyntheticSpec:
    """A second run of the same users, without a rollup (as if still replaying)."""
    return dataclasses.replace(users_spec(), run_id=LIVE_RUN, n=3_000, seed=22, duplicate_rate=0.0)


def mirror_users_spec() -> synthetic.SyntheticSpec:
    return dataclasses.replace(
        users_spec(), experiment="ttft-users-mirror", mode="mirror", n=1_500, run_id=33, seed=23
    )


def constant_spec() -> synthetic.SyntheticSpec:
    """Every request asks for the same max_tokens (as the synthetic default): one user per request."""
    return synthetic.SyntheticSpec(
        experiment="ttft-const",
        n=4_000,
        seed=24,
        run_id=34,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
    )


SPECS = (users_spec, live_spec, mirror_users_spec, constant_spec)


@pytest.fixture(scope="module")
def datasets() -> dict[str, synthetic.Synthetic]:
    return {fn.__name__: synthetic.generate(fn()) for fn in SPECS}


@pytest.fixture(scope="module")
def stores(chdb_dir: str, clickhouse_server: str, datasets) -> Iterator[dict[str, SampleStore]]:
    """Own databases holding every dataset; a rollup for the users' first run only."""
    out = load_stores(chdb_dir, "abplat_test_units", tuple(datasets.values()))
    for store in out.values():
        built = rollup.build_run_rollup(store, "ttft-users", RUN, SLO)
        assert built is not None
    yield out
    drop_stores(out)


@pytest.fixture(params=["chdb", "server"])
def store(request: pytest.FixtureRequest, stores) -> SampleStore:
    return stores[request.param]


def raw(datasets, *names: str, variant: str | None = None) -> dict[str, np.ndarray]:
    """The rows a deduplicated read returns, of these datasets (one variant's, if given)."""
    parts = [datasets[n].latest() for n in names]
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    keep = np.ones(cols["variant"].size, dtype=bool) if variant is None else cols["variant"] == variant
    return {k: v[keep] for k, v in cols.items()}


def per_request(c: dict[str, np.ndarray], metric: str, clustered: bool = True):
    """(values, covariates, cluster ids) of one metric over its requests, as stats takes them:
    the cluster is the user, None (a cluster of its own) for a request without one."""
    ok = c["outcome"] == "ok"
    with np.errstate(invalid="ignore"):
        hit = ok & (c["ttft_ms"] < SLO.ttft_ms)
    if metric == "mean_ttft_ms":
        keep = ok & ~np.isnan(c["ttft_ms"])
        y = c["ttft_ms"][keep]
    else:
        keep = np.ones(ok.size, dtype=bool)
        y = (hit if metric == "attainment" else ~ok).astype(float)
    x = np.c_[c["prompt_tokens"][keep], c["max_tokens"][keep]].astype(float)
    users = np.array([u or None for u in c["user_id"][keep]], dtype=object)
    return y, x, users if clustered else None


def close(a, b, rtol):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def report(store, spec_fn=users_spec, *, use_rollup=False, run_id=RUN, **switches):
    spec = spec_fn()
    return r.build_report(
        store, info(spec, **switches), q.Filters(spec.experiment, run_id=run_id), use_rollup=use_rollup
    )


def test_clustered_numbers_equal_stats_clustered_on_the_raw_samples(store, datasets):
    rep = report(store)
    assert rep["inference"]["unit"] == "user" and rep["inference"]["cluster_by_user"]
    arms = {}
    for entry in rep["variants"]:
        c = raw(datasets, "users_spec", variant=entry["key"])
        got = entry["clustered"]
        assert got["inference"] == "user-clustered"
        for metric in units.METRICS:
            y, _x, users = per_request(c, metric)
            want = clustered_mean(ClusterSums.from_samples(y, users, binary=metric != "mean_ttft_ms"))
            arms[(entry["key"], metric)] = ClusterSums.from_samples(y, users, binary=metric != "mean_ttft_ms")
            for field in (
                "estimate",
                "se",
                "lo",
                "hi",
                "se_iid",
                "design_effect",
                "effective_clusters",
                "largest_cluster_share",
            ):
                assert close(got[metric][field], getattr(want, field), 1e-9), (entry["key"], metric, field)
            assert (got[metric]["n"], got[metric]["clusters"]) == (want.n, want.clusters)
        if entry["control"]:
            assert entry["vs_control"] is None
            continue
        for metric, name in units.DIFFERENCES.items():
            want = clustered_difference(arms[("fp16", metric)], arms[(entry["key"], metric)])
            got = entry["vs_control"]["clustered"][name]
            assert got["inference"] == "user-clustered"
            for field in ("estimate", "se", "lo", "hi", "p_value", "se_iid", "design_effect"):
                assert close(got[field], getattr(want, field), 1e-9), (entry["key"], name, field)


def test_adjusted_differences_equal_stats_adjusted_on_the_raw_samples(store, datasets):
    rep = report(store)
    control = raw(datasets, "users_spec", variant="fp16")
    for entry in rep["variants"][1:]:
        c = raw(datasets, "users_spec", variant=entry["key"])
        adjusted = entry["vs_control"]["adjusted"]
        assert "not adjusted" in adjusted["note"] and "p99" in adjusted["note"]
        for metric, name in units.DIFFERENCES.items():
            yc, xc, uc = per_request(control, metric)
            yv, xv, uv = per_request(c, metric)
            want = adjusted_difference(
                ArmData.from_samples(yc, xc, uc, COVARIATES), ArmData.from_samples(yv, xv, uv, COVARIATES)
            )
            got = adjusted[name]
            assert got["inference"] == "user-clustered"
            assert got["adjusted"]["covariates"] == list(COVARIATES) and got["adjusted"]["not_used"] == {}
            for field in (
                "estimate",
                "se",
                "lo",
                "hi",
                "p_value",
                "unadjusted",
                "se_unadjusted",
                "se_iid",
                "control_mean",
                "variant_mean",
            ):
                assert close(got[field], getattr(want, field), 1e-6), (entry["key"], name, field)
            assert abs(got["variance_reduction"] - want.variance_reduction) < 1e-6
            assert got["adjusted"]["variance_reduction"] == got["variance_reduction"]
            assert np.allclose(got["theta"], want.theta, rtol=1e-6)


def test_users_with_many_correlated_requests_widen_the_intervals(store):
    """The users' requests share the user's TTFT factor: per user, the TTFT and attainment
    intervals are wider than those that count requests as independent. Errors here strike each
    request alike whoever sent it, and with one user per request nothing is correlated: no
    widening there."""
    rep = report(store)
    for entry in rep["variants"]:
        per = entry["clustered"]
        for metric in ("attainment", "mean_ttft_ms"):
            assert per[metric]["design_effect"] > 1.5, (entry["key"], metric)
            assert per[metric]["se"] > per[metric]["se_iid"]
        assert per["error_rate"]["design_effect"] < 1.5
        wilson = entry["attainment"]  # the request-level interval
        assert per["attainment"]["hi"] - per["attainment"]["lo"] > 1.2 * (wilson["hi"] - wilson["lo"])
        if entry["vs_control"]:
            d = entry["vs_control"]["clustered"]["attainment_difference"]
            newcombe = entry["vs_control"]["attainment_difference"]
            assert d["hi"] - d["lo"] > 1.2 * (newcombe["hi"] - newcombe["lo"])
    alone = report(store, constant_spec, run_id=None)  # one user per request
    for entry in alone["variants"]:
        for metric in units.METRICS:
            assert entry["clustered"][metric]["design_effect"] == pytest.approx(1.0, rel=1e-9)


def test_requests_without_a_user_are_units_of_their_own(store, datasets):
    rep = report(store)
    for entry in rep["variants"]:
        c = raw(datasets, "users_spec", variant=entry["key"])
        named = c["user_id"] != ""
        assert 0 < (~named).sum() < named.sum()
        want = np.unique(c["user_id"][named]).size + int((~named).sum())
        assert entry["clustered"]["attainment"]["clusters"] == want
        assert entry["clustered"]["attainment"]["n"] == c["user_id"].size
        ok = (c["outcome"] == "ok") & ~np.isnan(c["ttft_ms"])
        want_ok = np.unique(c["user_id"][named & ok]).size + int((~named & ok).sum())
        assert entry["clustered"]["mean_ttft_ms"]["clusters"] == want_ok


def _without_unit_keys(rep: dict) -> dict:
    def strip(e: dict) -> dict:
        return {
            **{k: v for k, v in e.items() if k != "clustered"},
            "vs_control": e["vs_control"]
            and {k: v for k, v in e["vs_control"].items() if k not in ("clustered", "adjusted")},
        }

    rep = {k: v for k, v in rep.items() if k != "inference"}
    rep["variants"] = [strip(e) for e in rep["variants"]]
    anytime = {k: v for k, v in rep["anytime"].items() if k != "units"}
    rep["anytime"] = {**anytime, "variants": {v: strip(e) for v, e in anytime["variants"].items()}}
    return rep


def test_the_switch_off_gives_the_request_level_report_and_reads_no_moments(store, monkeypatch):
    on = report(store)
    real = RawReader.unit_moments

    def refuse(*args, **kwargs):
        raise AssertionError("the per-user moments were read with the analysis off")

    monkeypatch.setattr(RawReader, "unit_moments", refuse)
    off = report(store, cluster_by_user=False, adjust=False)
    monkeypatch.setattr(RawReader, "unit_moments", real)
    assert off["inference"]["unit"] == "request" and "off for this experiment" in off["inference"]["note"]
    assert off["anytime"]["units"]["note"] == "off for this experiment"
    for entry in [*off["variants"], *off["anytime"]["variants"].values()]:
        assert entry["clustered"] is None
        assert entry["vs_control"] is None or (
            entry["vs_control"]["clustered"] is None and entry["vs_control"]["adjusted"] is None
        )
    assert_same(_without_unit_keys(on), _without_unit_keys(off))


def test_adjusting_without_clustering_treats_every_request_as_a_unit(store, datasets):
    rep = report(store, cluster_by_user=False)
    assert rep["inference"]["unit"] == "request" and all(e["clustered"] is None for e in rep["variants"])
    control = raw(datasets, "users_spec", variant="fp16")
    for entry in rep["variants"][1:]:
        assert entry["vs_control"]["clustered"] is None
        c = raw(datasets, "users_spec", variant=entry["key"])
        for metric, name in units.DIFFERENCES.items():
            yc, xc, _ = per_request(control, metric)
            yv, xv, _ = per_request(c, metric)
            want = adjusted_difference(
                ArmData.from_samples(yc, xc, None, COVARIATES), ArmData.from_samples(yv, xv, None, COVARIATES)
            )
            got = entry["vs_control"]["adjusted"][name]
            assert got["inference"] == "requests"
            assert got["control_clusters"] == yc.size  # every request its own unit
            for field in ("estimate", "se", "se_unadjusted"):
                assert close(got[field], getattr(want, field), 1e-6), (name, field)


@pytest.mark.parametrize("switches", [{}, {"cluster_by_user": False}], ids=["per-user", "per-request"])
@pytest.mark.parametrize("run_id, source", [(RUN, "rollup"), (None, "rollup+samples")], ids=["run", "mixed"])
def test_rollups_give_the_same_numbers_as_the_raw_samples(store, switches, run_id, source):
    fast = report(store, use_rollup=True, run_id=run_id, **switches)
    slow = report(store, use_rollup=False, run_id=run_id, **switches)
    assert fast["timing"]["source"] == source and slow["timing"]["source"] == "samples"
    assert fast["variants"][1]["vs_control"]["adjusted"]["mean_ttft_difference"]["estimate"] is not None
    assert_same(slow, fast)


def test_the_two_runs_cluster_a_returning_user_once(store, datasets):
    """Over both runs a user's requests in either run are one cluster: the numbers equal stats
    on the two runs' samples together (per-run moments would not add up)."""
    rep = report(store, use_rollup=True, run_id=None)
    entry = rep["variants"][1]
    c = raw(datasets, "users_spec", "live_spec", variant=entry["key"])
    y, _x, users = per_request(c, "mean_ttft_ms")
    want = clustered_mean(ClusterSums.from_samples(y, users))
    assert entry["clustered"]["mean_ttft_ms"]["clusters"] == want.clusters
    assert close(entry["clustered"]["mean_ttft_ms"]["se"], want.se, 1e-9)


def test_mirror_mode_keeps_its_paired_analysis(store):
    rep = report(store, mirror_users_spec, run_id=None)
    assert "mirror mode" in rep["inference"]["note"]
    for entry in rep["variants"]:
        assert entry["clustered"]["attainment"]["clusters"] > 0  # each arm's own interval per user
        if entry["vs_control"]:
            assert entry["vs_control"]["paired"] is not None
            assert entry["vs_control"]["clustered"] is None and entry["vs_control"]["adjusted"] is None


def test_a_constant_covariate_is_left_out_and_named(store, datasets):
    rep = report(store, constant_spec, run_id=None)
    control = raw(datasets, "constant_spec", variant="fp16")
    entry = rep["variants"][1]
    c = raw(datasets, "constant_spec", variant=entry["key"])
    got = entry["vs_control"]["adjusted"]["mean_ttft_difference"]
    assert got["adjusted"]["covariates"] == ["prompt_tokens"]
    assert got["adjusted"]["not_used"] == {"max_tokens": "constant over these requests (256)"}
    yc, xc, uc = per_request(control, "mean_ttft_ms")
    yv, xv, uv = per_request(c, "mean_ttft_ms")
    want = adjusted_difference(
        ArmData.from_samples(yc, xc[:, :1], uc, ("prompt_tokens",)),
        ArmData.from_samples(yv, xv[:, :1], uv, ("prompt_tokens",)),
    )
    assert close(got["estimate"], want.estimate, 1e-6) and close(got["se"], want.se, 1e-6)
    # TTFT grows with the prompt: with one user per request, adjusting on it removes a good share
    # of the variance (with the users above, their own factor dominates and it removes little)
    assert got["variance_reduction"] > 0.1


def test_a_bad_unit_is_refused():
    with pytest.raises(ValueError, match="unit must be one of"):
        units.moments_select(q.Filters("x"), SLO, "session")


@pytest.mark.parametrize("unit", units.UNITS)
def test_moments_of_one_block_equal_that_block_of_every_block_and_refuse_the_others(store, unit):
    """A reader of some metrics alone (a rollout step's guardrails: attainment and error rate)
    reads their block: the same numbers there as the whole query, zeros elsewhere, and a metric
    of a block not read is refused rather than read as "no request"."""
    spec = users_spec()
    f = q.Filters(spec.experiment, run_id=RUN)
    every = RawReader(store).unit_moments(f, SLO, unit)
    sql, params = units.moments_select(f, SLO, unit, blocks=units.blocks_of(["attainment", "error_rate"]))
    alone = units.rows_to_moments(store.query(sql, params), ("all",))
    assert set(alone) == set(every) and len(every) == 3
    lay = units.layout()
    for variant, got in alone.items():
        want = every[variant]
        assert got.read() == ("all",) and want.read() == units.BLOCKS
        for key, i in [*lay.total.items(), *lay.cross.items()]:
            if key[0] == "all":
                assert got.sums[i] == pytest.approx(want.sums[i], rel=1e-12, abs=1e-9), (variant, key)
            else:
                assert got.sums[i] == 0.0, (variant, key)
        for b_i, block in enumerate(lay.blocks):
            pair = got.counts[2 * b_i : 2 * b_i + 2]
            assert pair == (want.counts[2 * b_i : 2 * b_i + 2] if block == "all" else (0, 0))
        for metric in ("attainment", "error_rate"):
            a, b = got.arm(metric, COVARIATES), want.arm(metric, COVARIATES)
            assert a.clusters == b.clusters and np.allclose(a.cross, b.cross, rtol=1e-12)
        with pytest.raises(ValueError, match="mean_ttft_ms: its block 'ttft' was not read"):
            got.arm("mean_ttft_ms")
        with pytest.raises(ValueError, match="do not add"):
            got.add(want)
        assert got.add(got).counts[0] == 2 * got.counts[0]


def test_blocks_are_checked_and_kept_in_layout_order():
    assert units.blocks_of(["mean_ttft_ms", "attainment"]) == ("all", "ttft") == units.BLOCKS
    assert units.vector_positions(("ttft",))[("ttft", "n")] == 0
    assert len(units.vector_sums(SLO, ("all",))[0]) == len(units.layout().components["all"])
    for bad in ((), ("all", "p99")):
        with pytest.raises(ValueError, match="blocks must be some of"):
            units.moments_select(q.Filters("x"), SLO, "user", blocks=bad)


@pytest.mark.parametrize("kind", ["chdb", "server"])
def test_moments_of_another_layout_are_not_read_from_the_rollup(kind, shared_store):
    """A build's moments in another layout (written by other code) are not trusted: the report
    reads the moments from the samples, with the same numbers."""
    from samples import schema

    store = shared_store(kind)  # the session's migrated database, empty (tests/sample_dbs.py)
    spec = dataclasses.replace(users_spec(), n=1_500, duplicate_rate=0.0)
    synthetic.insert(store, synthetic.generate(spec))
    built = rollup.build_run_rollup(store, spec.experiment, RUN, SLO)
    good = r.build_report(store, info(spec), q.Filters(spec.experiment))
    assert good["timing"]["source"] == "rollup"
    store.execute(
        f"INSERT INTO {schema.ROLLUP_MOMENTS_TABLE} (build_id, unit, variant, counts, sums) "
        "SELECT %(b)s, 'user', 'awq', [1, 1], [1.0, 2.0]",
        {"b": built.build_id},
    )
    again = r.build_report(store, info(spec), q.Filters(spec.experiment))
    assert again["timing"]["source"] == "rollup"  # the rest still from the rollup
    assert_same(good, again)


def test_a_collinear_covariate_is_dropped_and_named():
    rng = np.random.default_rng(9)

    def arm(shift: float):
        prompt = rng.integers(10, 4000, 500).astype(float)
        y = 80 + 0.04 * prompt + rng.normal(0, 5, 500) + shift
        x = np.c_[prompt, 2 * prompt]  # max_tokens always twice the prompt here
        return ArmData.from_samples(y, x, rng.integers(0, 100, 500), COVARIATES).arm_moments()

    got = units.adjusted_entry(arm(0.0), arm(3.0), "user-clustered")
    assert got["adjusted"]["covariates"] == ["prompt_tokens"]
    assert got["adjusted"]["not_used"] == {"max_tokens": "collinear with prompt_tokens"}
    assert got["estimate"] is not None and got["variance_reduction"] > 0.5


# ---- the anytime-valid counterparts (analysis.anytime.unit_sequences) -------------------------

ALPHA = 0.05
TARGET_N, MIN_USERS = 10_000, 50


def mixture_bounds(estimate, se, n, binary, low):
    """The normal-mixture confidence sequence at ``n`` requests around a fixed-horizon estimate
    and its standard error, from its formula (stats.sequential.adjusted's docstring): the
    half-width sqrt(se^2 (1 + 1/r) (log(1 + r) + 2 log(1/alpha))), r = r* n / TARGET_N with r*
    the root of r = 2 log(1/alpha) + log(1 + r); a share's bounds clipped to its range."""
    two_l = 2.0 * math.log(1.0 / ALPHA)
    r_star = optimize.brentq(lambda r: r - two_l - math.log1p(r), 1.0, 100.0, xtol=1e-15, rtol=1e-15)
    r = r_star * n / TARGET_N
    half = math.sqrt(se * se * (1.0 + 1.0 / r) * (math.log1p(r) + two_l))
    lo, hi = estimate - half, estimate + half
    if binary:
        lo, hi = min(max(lo, low), 1.0), min(max(hi, low), 1.0)
    return estimate, lo, hi


def same_sequence(got, want, rtol, where):
    assert got["alpha"] == ALPHA and got["note"] is None, where
    for field, value in zip(("estimate", "lo", "hi"), want, strict=True):
        assert close(got[field], value, rtol), (where, field, got[field], value)


def test_anytime_clustered_sequences_are_the_normal_mixture_on_the_raw_samples(store, datasets):
    rep = report(store)
    seqs = rep["anytime"]["variants"]
    assert rep["anytime"]["units"] == {
        "unit": "user",
        "cluster_by_user": True,
        "adjust": True,
        "target_n": TARGET_N,
        "min_clusters": MIN_USERS,
        "note": rep["anytime"]["units"]["note"],
    }
    arms = {}
    for entry in rep["variants"]:
        v = entry["key"]
        c = raw(datasets, "users_spec", variant=v)
        assert seqs[v]["clustered"]["inference"] == "user-clustered"
        for metric in units.METRICS:
            binary = metric != "mean_ttft_ms"
            y, _x, users = per_request(c, metric)
            arms[(v, metric)] = arm = ClusterSums.from_samples(y, users, binary=binary)
            fixed = clustered_mean(arm)
            got = seqs[v]["clustered"][metric]
            assert got["inference"] == "user-clustered"
            same_sequence(
                got, mixture_bounds(fixed.estimate, fixed.se, y.size, binary, 0.0), 1e-9, (v, metric)
            )
            # wider than the fixed-horizon interval beside it (variants[].clustered)
            assert (
                got["lo"] < entry["clustered"][metric]["lo"] and entry["clustered"][metric]["hi"] < got["hi"]
            )
        if entry["control"]:
            assert seqs[v]["vs_control"] is None
            continue
        for metric, name in units.DIFFERENCES.items():
            binary = metric != "mean_ttft_ms"
            fixed = clustered_difference(arms[("fp16", metric)], arms[(v, metric)])
            n = int(arms[("fp16", metric)].n.sum() + arms[(v, metric)].n.sum())
            got = seqs[v]["vs_control"]["clustered"][name]
            assert got["inference"] == "user-clustered"
            same_sequence(got, mixture_bounds(fixed.estimate, fixed.se, n, binary, -1.0), 1e-9, (v, name))
            assert close(got["estimate"], entry["vs_control"]["clustered"][name]["estimate"], 1e-12)


@pytest.mark.parametrize("cluster_by_user", [True, False], ids=["per-user", "per-request"])
def test_anytime_adjusted_sequences_are_the_normal_mixture_on_the_raw_samples(
    store, datasets, cluster_by_user
):
    rep = report(store, cluster_by_user=cluster_by_user)
    control = raw(datasets, "users_spec", variant="fp16")
    inference = "user-clustered" if cluster_by_user else "requests"
    assert rep["anytime"]["units"]["unit"] == ("user" if cluster_by_user else "request")
    for entry in rep["variants"][1:]:
        v = entry["key"]
        c = raw(datasets, "users_spec", variant=v)
        seq = rep["anytime"]["variants"][v]
        assert (seq["clustered"] is None) == (not cluster_by_user)
        assert (seq["vs_control"]["clustered"] is None) == (not cluster_by_user)
        adjusted = seq["vs_control"]["adjusted"]
        assert adjusted["inference"] == inference and "not adjusted" in adjusted["note"]
        for metric, name in units.DIFFERENCES.items():
            yc, xc, uc = per_request(control, metric, clustered=cluster_by_user)
            yv, xv, uv = per_request(c, metric, clustered=cluster_by_user)
            fixed = adjusted_difference(
                ArmData.from_samples(yc, xc, uc, COVARIATES), ArmData.from_samples(yv, xv, uv, COVARIATES)
            )
            got = adjusted[name]
            assert got["inference"] == inference
            # adjusted on what the fixed-horizon difference beside it was adjusted on
            assert got["adjusted"] == entry["vs_control"]["adjusted"][name]["adjusted"]
            assert got["adjusted"]["covariates"] == list(COVARIATES)
            assert abs(got["adjusted"]["variance_reduction"] - fixed.variance_reduction) < 1e-6
            want = mixture_bounds(fixed.estimate, fixed.se, yc.size + yv.size, metric != "mean_ttft_ms", -1.0)
            same_sequence(got, want, 1e-6, (v, name))


def test_anytime_adjusted_sequences_leave_a_constant_covariate_out_as_the_fixed_horizon_ones(store, datasets):
    rep = report(store, constant_spec, run_id=None)
    entry = rep["variants"][1]
    got = rep["anytime"]["variants"][entry["key"]]["vs_control"]["adjusted"]["mean_ttft_difference"]
    assert got["adjusted"]["covariates"] == ["prompt_tokens"]
    assert got["adjusted"]["not_used"] == {"max_tokens": "constant over these requests (256)"}
    control = raw(datasets, "constant_spec", variant="fp16")
    c = raw(datasets, "constant_spec", variant=entry["key"])
    yc, xc, uc = per_request(control, "mean_ttft_ms")
    yv, xv, uv = per_request(c, "mean_ttft_ms")
    fixed = adjusted_difference(
        ArmData.from_samples(yc, xc[:, :1], uc, ("prompt_tokens",)),
        ArmData.from_samples(yv, xv[:, :1], uv, ("prompt_tokens",)),
    )
    same_sequence(got, mixture_bounds(fixed.estimate, fixed.se, yc.size + yv.size, False, 0.0), 1e-6, "ttft")


def test_anytime_unit_sequences_in_mirror_mode_are_per_variant_only(store):
    rep = report(store, mirror_users_spec, run_id=None)
    for v, seq in rep["anytime"]["variants"].items():
        assert seq["clustered"]["attainment"]["lo"] is not None, v
        if seq["vs_control"] is not None:
            assert seq["vs_control"]["clustered"] is None and seq["vs_control"]["adjusted"] is None
            assert seq["vs_control"]["attainment_difference"]["lo"] is not None  # the request-level ones stay


@pytest.mark.parametrize("kind", ["chdb", "server"])
def test_anytime_unit_sequences_have_no_bounds_before_enough_users(kind, shared_store):
    store = shared_store(kind)  # the session's migrated database, empty (tests/sample_dbs.py)
    spec = dataclasses.replace(
        users_spec(), experiment="ttft-few", n=600, users=30, no_user_share=0.0, duplicate_rate=0.0
    )
    store.insert_columns(synthetic.generate(spec).columns)
    rep = r.build_report(store, info(spec), q.Filters(spec.experiment))
    for entry in rep["variants"]:
        seq = rep["anytime"]["variants"][entry["key"]]
        assert entry["clustered"]["attainment"]["clusters"] < MIN_USERS
        for metric in units.METRICS:
            got = seq["clustered"][metric]
            assert got["estimate"] is not None and got["lo"] is None and got["hi"] is None
            assert got["note"] == f"fewer than {MIN_USERS} units in an arm: no bounds yet"
        if seq["vs_control"]:
            got = seq["vs_control"]["clustered"]["attainment_difference"]
            assert got["lo"] is None and "no bounds yet" in got["note"]
            # the request-level sequence beside it has bounds
            assert seq["vs_control"]["attainment_difference"]["lo"] is not None
