# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""Setup errors (a 4xx the variant answered because of how it is configured or called) are
counted apart per variant, flagged in a banner, and change no other figure of the report: the
report over samples with setup errors equals, but for setup_errors, the banners and SRM (a user
is assigned whatever the variant answers), the report over the same samples without them, on the
raw path and from the rollups alike, on chDB and the ClickHouse server."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from analysis import rollup
from samples import synthetic
from samples.store import SampleStore
from tests.analysis.fixtures_report import SLO, assert_same, drop_stores, info, load_stores

pytestmark = pytest.mark.services

WALKTHROUGH = "404 The model 'tiny-llama' does not exist"
# (variant, rows, outcome, status, message): setup errors on two arms, the control's included;
# 429 and 408 are load and must stay misses.
SETUP = (
    ("awq-fa2", 60, "http_4xx", 404, WALKTHROUGH),
    ("fp16", 7, "http_4xx", 401, "401 Unauthorized"),
    ("awq", 5, "http_4xx", 422, "422 Unprocessable Entity: max_tokens must be at least 1"),
)
LOAD = (
    ("awq", 9, "http_4xx", 429, "429 Too Many Requests"),
    ("awq", 4, "http_4xx", 408, "408 Request Timeout"),
)
FAILED_COLUMNS = (
    "first_byte_ms",
    "ttft_event_ms",
    "ttft_ms",
    "itl_mean_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "tpot_ms",
    "e2e_ms",
)


def _spec(experiment: str, mode: str = "split") -> synthetic.SyntheticSpec:
    return synthetic.SyntheticSpec(
        experiment=experiment,
        mode=mode,
        n=5_000,
        seed=31,
        run_id=31,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        config_revisions=(201,),
        duration_s=900.0,
        users=400,
        user_sigma=0.3,
    )


def _fail(cols: dict[str, np.ndarray], rows: np.ndarray, outcome: str, status: int, message: str) -> None:
    """Rows as a variant answering `status` at once: no latency, no tokens, no gaps."""
    cols["outcome"][rows] = outcome
    cols["http_status"][rows] = status
    cols["error"][rows] = message
    for name in FAILED_COLUMNS:
        cols[name][rows] = np.nan
    cols["output_tokens"][rows] = 0
    cols["chunks"][rows] = 0
    cols["finish_reason"][rows] = ""
    for i in rows.tolist():
        cols["itl_gaps_us"][i] = np.zeros(0, dtype=np.uint32)


def _with_failures(
    data: synthetic.Synthetic, plan, rng: np.random.Generator
) -> tuple[synthetic.Synthetic, np.ndarray]:
    """A copy of data with plan's rows failed; and the mask of the setup-error rows."""
    cols = {k: v.copy() for k, v in data.columns.items()}
    cols["itl_gaps_us"] = np.array(list(cols["itl_gaps_us"]) + [None], dtype=object)[:-1]
    setup = np.zeros(data.n_rows, dtype=bool)
    taken = np.zeros(data.n_rows, dtype=bool)
    for variant, k, outcome, status, message in plan:
        mine = (cols["variant"] == variant) & ~taken
        # k None: every request of the variant; else k of its successful ones
        rows = (
            np.flatnonzero(mine)
            if k is None
            else rng.choice(np.flatnonzero(mine & (cols["outcome"] == "ok")), k, replace=False)
        )
        taken[rows] = True
        _fail(cols, rows, outcome, status, message)
        setup[rows] = status not in q.SETUP_LOAD_STATUSES
    return dataclasses.replace(data, columns=cols), setup


def _without(data: synthetic.Synthetic, drop: np.ndarray, experiment: str) -> synthetic.Synthetic:
    cols = {k: v[~drop] for k, v in data.columns.items()}
    cols["experiment"] = np.full(int((~drop).sum()), experiment, dtype=object)
    return synthetic.Synthetic(
        dataclasses.replace(data.spec, experiment=experiment), cols, data.is_duplicate[~drop]
    )


@dataclasses.dataclass
class Case:
    data: synthetic.Synthetic  # with the setup errors
    setup: np.ndarray  # its setup-error rows
    clean: synthetic.Synthetic  # the same without those rows, another experiment key
    mirror: synthetic.Synthetic  # a mirror replay with setup errors on one arm
    mirror_clean: synthetic.Synthetic
    unjudged: synthetic.Synthetic  # awq answers every request 401
    live: synthetic.Synthetic  # the gateway's live traffic with setup errors
    live_clean: synthetic.Synthetic
    no_control: synthetic.Synthetic  # the control answers every request 404


@pytest.fixture(scope="module")
def case() -> Case:
    rng = np.random.default_rng(5)
    base = synthetic.generate(_spec("setup-errs"))
    data, setup = _with_failures(base, SETUP + LOAD, rng)
    mirror_base = synthetic.generate(_spec("setup-mirror", mode="mirror"))
    mirror, mirror_setup = _with_failures(mirror_base, SETUP[:1], rng)
    everything = (("awq", None, "http_4xx", 401, "401 Unauthorized: invalid API key"),)
    unjudged, _ = _with_failures(synthetic.generate(_spec("setup-all")), everything, rng)
    live_base = synthetic.generate(_spec("setup-live"))
    live_base.columns["mode"] = np.full(live_base.n_rows, "live", dtype=object)
    live, live_setup = _with_failures(live_base, SETUP + LOAD, rng)
    control_refuses = (("fp16", None, "http_4xx", 404, WALKTHROUGH),)
    no_control, _ = _with_failures(synthetic.generate(_spec("setup-no-control")), control_refuses, rng)
    return Case(
        data,
        setup,
        _without(data, setup, "setup-clean"),
        mirror,
        _without(mirror, mirror_setup, "setup-mirror-clean"),
        unjudged,
        live,
        _without(live, live_setup, "setup-live-clean"),
        no_control,
    )


@pytest.fixture(scope="module")
def stores(chdb_dir: str, clickhouse_server: str, case: Case) -> Iterator[dict[str, SampleStore]]:
    datasets = (
        case.data,
        case.clean,
        case.mirror,
        case.mirror_clean,
        case.unjudged,
        case.live,
        case.live_clean,
        case.no_control,
    )
    out = load_stores(chdb_dir, "abplat_test_setup", datasets)
    yield out
    drop_stores(out)


@pytest.fixture(params=["chdb", "server"])
def store(request: pytest.FixtureRequest, stores) -> SampleStore:
    return stores[request.param]


def _report(store: SampleStore, data: synthetic.Synthetic, use_rollup: bool = False) -> dict:
    spec = data.spec
    return r.build_report(store, info(spec), q.Filters(spec.experiment), use_rollup=use_rollup)


def _judged_figures(report: dict) -> dict:
    """The report but for what setup errors may change: their own keys, the banners, SRM (users
    are counted whatever the variant answered), the experiment's key and the timings."""
    out = {k: v for k, v in report.items() if k not in ("banners", "srm", "experiment", "filters", "timing")}
    out["variants"] = [{k: v for k, v in e.items() if k != "setup_errors"} for e in report["variants"]]
    out["anytime"] = {k: v for k, v in report["anytime"].items() if k != "srm"}
    return out


def test_setup_errors_are_counted_apart_by_status_with_an_example(store, case):
    rep = _report(store, case.data)
    cols = {k: v[~case.data.is_duplicate] for k, v in case.data.columns.items()}
    for e in rep["variants"]:
        mine = cols["variant"] == e["key"]
        setup = mine & case.setup
        judged = mine & ~case.setup
        statuses = sorted({int(s) for s in cols["http_status"][setup]})
        got = e["setup_errors"]
        assert got["n"] == int(setup.sum())
        assert sorted(int(s) for s in got["by_status"]) == statuses
        for status in statuses:
            entry = got["by_status"][str(status)]
            assert entry["n"] == int((setup & (cols["http_status"] == status)).sum())
            assert entry["example"] in set(cols["error"][setup & (cols["http_status"] == status)])
        assert got["share"] == pytest.approx(setup.sum() / mine.sum())
        # n, errors and hits count the judged requests only; 429 and 408 are load: misses
        ok = cols["outcome"][judged] == "ok"
        hits = ok & (cols["ttft_ms"][judged] < SLO.ttft_ms)
        assert (e["n"], e["errors"], e["hits"]) == (int(judged.sum()), int((~ok).sum()), int(hits.sum()))
        assert e["error_rate"] == pytest.approx((~ok).sum() / judged.sum())
        assert e["error_rate_includes_setup_errors"] is False
        assert "http_4xx" not in e["failures"] or e["failures"]["http_4xx"]["http_status"] in (408, 429)
    awq = next(e for e in rep["variants"] if e["key"] == "awq")
    assert awq["failures"]["http_4xx"]["n"] == 13  # the 429s and 408s, as misses


def test_setup_errors_change_no_other_figure_raw_or_rolled_up(store, case):
    with_errors = _report(store, case.data)
    clean = _report(store, case.clean)
    assert_same(_judged_figures(with_errors), _judged_figures(clean))
    for data in (case.data, case.clean):
        built = rollup.build_run_rollup(store, data.spec.experiment, data.spec.run_id, SLO)
        assert built is not None
    rolled = _report(store, case.data, use_rollup=True)
    assert rolled["timing"]["source"] == "rollup"
    assert_same(_judged_figures(rolled), _judged_figures(with_errors))
    assert [e["setup_errors"] for e in rolled["variants"]] == [
        e["setup_errors"] for e in with_errors["variants"]
    ]


def test_mirror_replay_pairs_only_judged_requests(store, case):
    """A mirror replay's paired analysis leaves the setup errors out as the rest does."""
    assert_same(
        _judged_figures(_report(store, case.mirror)), _judged_figures(_report(store, case.mirror_clean))
    )


def test_live_traffic_leaves_them_out_as_a_replay_does(store, case):
    rep = _report(store, case.live)
    assert rep["runs"]["mode"] == "live"
    assert_same(_judged_figures(rep), _judged_figures(_report(store, case.live_clean)))
    fa2 = next(e for e in rep["variants"] if e["key"] == "awq-fa2")
    assert fa2["setup_errors"]["by_status"]["404"]["n"] == 60


def test_a_control_answering_every_request_with_a_setup_error_compares_nothing(store, case):
    rep = _report(store, case.no_control)
    fp16 = next(e for e in rep["variants"] if e["key"] == "fp16")
    assert fp16["verdict"]["verdict"] == r.UNJUDGED and fp16["n"] == 0
    assert all(e["vs_control"] is None for e in rep["variants"])
    assert rep["attribution"]["attainment"] == {} and "control" in rep["attribution"]["note"]
    assert any(b.startswith("Setup errors on control fp16") for b in rep["banners"])
    judged = [e for e in rep["variants"] if not e["control"]]
    assert all(e["verdict"]["verdict"] != r.UNJUDGED and e["n"] > 0 for e in judged)


def test_each_variant_with_setup_errors_gets_one_banner_saying_what_to_check(store, case):
    rep = _report(store, case.data)
    lines = [b for b in rep["banners"] if b.startswith("Setup errors")]
    assert len(lines) == 3
    fa2 = next(b for b in lines if "variant awq-fa2" in b)
    assert "60 x 404" in fa2 and "tiny-llama" in fa2 and "model name" in fa2
    control = next(b for b in lines if "control fp16" in b)
    assert "7 x 401" in control and "credentials" in control
    assert not any("429" in b or "408" in b for b in lines)


def test_a_setup_error_is_never_blamed_on_a_factor(store, case):
    """The walkthrough's 404s on awq-fa2 move none of its attainment, so the attribution is the
    one of the samples without them (the figure is compared whole above; here its text)."""
    with_errors = _report(store, case.data)["attribution"]
    clean = _report(store, case.clean)["attribution"]
    for v, entry in with_errors["attainment"].items():
        assert entry["text"] == clean["attainment"][v]["text"]


def test_a_variant_answering_every_request_with_a_setup_error_cannot_be_judged(store, case):
    rep = _report(store, case.unjudged)
    awq = next(e for e in rep["variants"] if e["key"] == "awq")
    assert awq["n"] == 0 and awq["attainment"] is None
    assert awq["verdict"]["verdict"] == r.UNJUDGED != "misses"
    assert "every request" in awq["verdict"]["message"] and "401" in awq["verdict"]["message"]
    assert awq["setup_errors"]["share"] == 1.0
    # no factor, comparison or phase of it: it is not among the variants read
    assert "awq" not in rep["attribution"]["attainment"]
    assert "awq" not in rep["phases"]
    assert next(e for e in rep["variants"] if e["key"] == "awq-fa2")["vs_control"] is not None
    assert any("variant awq" in b and "401" in b for b in rep["banners"])


def test_setup_error_predicate_names_the_load_statuses():
    assert q.SETUP_LOAD_STATUSES == (408, 429)
    assert "http_4xx" in q.SETUP_ERROR and "408, 429" in q.SETUP_ERROR
