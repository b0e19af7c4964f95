"""The default report reads completed runs of one mode (analysis.runs)."""

from __future__ import annotations

import datetime as dt

import pytest

from analysis import definitions as q
from analysis import report as r
from samples import synthetic

EXP = "cat"


def cols(run_id: int, mode: str, n: int, *, start_ms: float, skew: bool = False) -> dict:
    variants = synthetic.demo_variants()
    if skew:  # a cancelled run stopped early: its arms are far from the weights
        variants = [
            synthetic.VariantSpec(v.key, w, v.factors, control=v.control)
            for v, w in zip(variants, (80, 10, 10))
        ]
    spec = synthetic.SyntheticSpec(
        experiment=EXP,
        mode=mode,
        n=n,
        seed=run_id,
        run_id=run_id,
        variants=variants,
        duration_s=60.0,
        start_unix_ms=start_ms,
    )
    return synthetic.generate(spec).columns


@pytest.fixture
def store(shared_store):
    return shared_store("chdb")  # the session's migrated chDB database, empty (tests/sample_dbs.py)


def info(**over) -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=EXP,
        name=EXP,
        slo=q.Slo(200.0),
        target=0.9,
        variants=[
            r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in synthetic.demo_variants()
        ],
        **over,
    )


T0 = synthetic.DEFAULT_START_MS


def test_a_cancelled_run_stays_out_of_the_default_report(store):
    store.insert_columns(cols(1, "split", 3000, start_ms=T0))
    store.insert_columns(cols(2, "split", 3000, start_ms=T0 + 120_000, skew=True))
    both = r.build_report(store, info(), q.Filters(EXP))  # no catalog rows: both runs are read
    assert both["srm"]["flagged"] and sum(v["n"] for v in both["variants"]) == 6000
    store.record_run(1, EXP, "split", "done")
    store.record_run(2, EXP, "split", "cancelled")
    rep = r.build_report(store, info(), q.Filters(EXP))
    assert sum(v["n"] for v in rep["variants"]) == 3000 and not rep["srm"]["flagged"]  # no false SRM
    assert rep["runs"]["read"] == [{"run_id": 1, "status": "done", "mode": "split", "partial": False}]
    assert rep["runs"]["not_read"] == [
        {"run_id": 2, "status": "cancelled", "mode": "split", "reason": "status"}
    ]
    assert rep["runs"]["notes"] == [
        "not read (not completed): cancelled run 2; ask for them with the status filter"
    ]
    assert rep["banners"] == []
    asked = r.build_report(store, info(), q.Filters(EXP, status=("done", "cancelled")))
    assert sum(v["n"] for v in asked["variants"]) == 6000
    assert "includes cancelled run 2: partial" in asked["banners"]
    assert asked["filters"]["status"] == ["done", "cancelled"]
    only = r.build_report(store, info(), q.Filters(EXP, run_id=2))  # asked for by id: read, labelled
    assert sum(v["n"] for v in only["variants"]) == 3000
    assert only["banners"][-1] == "includes cancelled run 2: partial"
    running = r.build_report(store, info(), q.Filters(EXP, status=("running",)))
    assert sum(v["n"] for v in running["variants"]) == 0 and running["runs"]["read"] == []


def test_modes_are_never_mixed_unless_asked(store):
    store.insert_columns(cols(1, "split", 600, start_ms=T0))
    store.insert_columns(cols(2, "mirror", 200, start_ms=T0 + 120_000))
    store.insert_columns(cols(3, "split", 600, start_ms=T0 + 240_000))  # uncatalogued, split
    store.record_run(1, EXP, "split", "done")
    store.record_run(2, EXP, "mirror", "done")
    rep = r.build_report(store, info(), q.Filters(EXP))  # run 3 is the latest: split
    assert rep["modes"] == {"split": 1200}
    assert (rep["runs"]["mode"], rep["runs"]["mode_source"]) == ("split", "the latest completed run (3)")
    assert rep["runs"]["available_modes"] == {"mirror": [2]}
    assert [x["run_id"] for x in rep["runs"]["read"]] == [1, 3]
    assert "mirror runs [2] are available with mode=mirror" in rep["runs"]["notes"][0]
    mirror = r.build_report(store, info(), q.Filters(EXP, mode="mirror"))
    assert mirror["modes"] == {"mirror": 600} and mirror["runs"]["mode_source"] == "filter"
    assert mirror["variants"][1]["vs_control"]["paired"] is not None


def test_one_run_without_a_catalog_row_is_read_as_before(store):
    store.insert_columns(cols(4, "mirror", 100, start_ms=T0))
    rep = r.build_report(store, info(), q.Filters(EXP))
    assert rep["runs"]["read"] == [
        {"run_id": 4, "status": "uncatalogued", "mode": "mirror", "partial": False}
    ]
    assert rep["runs"]["mode"] == "mirror" and sum(v["n"] for v in rep["variants"]) == 300
    assert r.build_report(store, info(), q.Filters(EXP, mode="split"))["variants"][0]["n"] == 0


def test_audit_markers_only_inside_the_window(store):
    store.insert_columns(cols(1, "split", 300, start_ms=T0))
    iso = lambda ms: dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat().replace("+00:00", "Z")  # noqa: E731
    changes = [
        {"at": iso(T0 - 86_400_000), "label": "before"},
        {"at": iso(T0 + 30_000), "label": "inside"},
        {"at": iso(T0 + 86_400_000), "label": "after"},
    ]
    rep = r.build_report(store, info(weight_changes=changes), q.Filters(EXP))
    assert [m["label"] for m in rep["timeseries"]["markers"] if m["kind"] == "audit"] == ["inside"]
    since = dt.datetime.fromtimestamp(T0 / 1000 + 40, dt.UTC)
    rep = r.build_report(store, info(weight_changes=changes), q.Filters(EXP, since=since))
    assert [m for m in rep["timeseries"]["markers"] if m["kind"] == "audit"] == []


def test_filters_check_status_and_mode():
    with pytest.raises(q.QueryError, match="status="):
        q.Filters(EXP, status=("finished",))
    with pytest.raises(q.QueryError, match="mode="):
        q.Filters(EXP, mode="shadow")
    assert q.Filters(EXP, status=("done",), mode="split").as_dict()["mode"] == "split"
