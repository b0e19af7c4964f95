"""Live traffic (mode "live", the gateway's runs) is a source the report reads beside
the replays, never mixed with them, chosen by the same rule (analysis.runs)."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from analysis.runs import select_runs
from samples import synthetic
from samples.columns import MODES

EXP = "cat"
LIVE_RUN = 10**12 + 1  # gateway.models.LIVE_RUN_ID_BASE + the LiveRun's pk
T0 = synthetic.DEFAULT_START_MS


def cols(run_id: int, mode: str, n: int, *, start_ms: float) -> dict:
    """n requests of one run. Live traffic is split by the weights, one variant a request, so a
    live run is generated as a split one and its rows say mode live, as the gateway's do."""
    spec = synthetic.SyntheticSpec(
        experiment=EXP,
        mode="split" if mode == "live" else mode,
        n=n,
        seed=run_id % 10_000,
        run_id=run_id,
        variants=synthetic.demo_variants(),
        duration_s=60.0,
        start_unix_ms=start_ms,
    )
    columns = synthetic.generate(spec).columns
    columns["mode"] = np.full(len(columns["mode"]), mode, dtype=object)
    return columns


@pytest.fixture
def store(shared_store):
    return shared_store("chdb")  # the session's migrated chDB database, empty (tests/sample_dbs.py)


def info() -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=EXP,
        name=EXP,
        slo=q.Slo(200.0),
        target=0.9,
        variants=[
            r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in synthetic.demo_variants()
        ],
    )


def n_read(rep: dict) -> int:
    return sum(v["n"] for v in rep["variants"])


def test_live_is_a_mode_samples_filters_and_the_catalog_take():
    assert "live" in MODES
    assert q.Filters(EXP, mode="live").as_dict()["mode"] == "live"


def test_live_traffic_newer_than_the_replays_is_read_by_default_and_the_replays_listed(store):
    store.insert_columns(cols(1, "split", 600, start_ms=T0))
    store.insert_columns(cols(2, "mirror", 200, start_ms=T0 + 120_000))
    store.insert_columns(cols(LIVE_RUN, "live", 900, start_ms=T0 + 240_000))  # no catalog row
    store.record_run(1, EXP, "split", "done")
    store.record_run(2, EXP, "mirror", "done")
    rep = r.build_report(store, info(), q.Filters(EXP))
    assert rep["modes"] == {"live": 900} and n_read(rep) == 900
    runs = rep["runs"]
    assert (runs["mode"], runs["mode_source"]) == ("live", f"the latest completed run ({LIVE_RUN})")
    assert runs["read"] == [{"run_id": LIVE_RUN, "status": "uncatalogued", "mode": "live", "partial": False}]
    assert runs["available_modes"] == {"mirror": [2], "split": [1]}
    assert "split runs [1] are available with mode=split (runs of two modes are never mixed)" in runs["notes"]
    # The replays, asked for by mode: the live run is listed as available beside them.
    split = r.build_report(store, info(), q.Filters(EXP, mode="split"))
    assert split["modes"] == {"split": 600} and [x["run_id"] for x in split["runs"]["read"]] == [1]
    assert split["runs"]["available_modes"] == {"live": [LIVE_RUN], "mirror": [2]}
    assert f"live runs [{LIVE_RUN}] are available with mode=live" in " ".join(split["runs"]["notes"])


def test_replays_newer_than_live_traffic_stay_the_default_and_live_is_picked_by_mode(store):
    store.insert_columns(cols(LIVE_RUN, "live", 300, start_ms=T0))
    store.insert_columns(cols(LIVE_RUN + 1, "live", 300, start_ms=T0 + 60_000))  # the gateway restarted
    store.insert_columns(cols(3, "split", 600, start_ms=T0 + 240_000))
    store.record_run(3, EXP, "split", "done")
    rep = r.build_report(store, info(), q.Filters(EXP))
    assert rep["modes"] == {"split": 600} and rep["runs"]["available_modes"] == {
        "live": [LIVE_RUN, LIVE_RUN + 1]
    }
    live = r.build_report(store, info(), q.Filters(EXP, mode="live"))
    assert live["modes"] == {"live": 600} and live["runs"]["mode_source"] == "filter"
    assert [x["run_id"] for x in live["runs"]["read"]] == [LIVE_RUN, LIVE_RUN + 1]  # both starts, one source
    assert live["runs"]["available_modes"] == {"split": [3]}


def test_a_live_run_still_recording_is_read_not_partial_while_a_running_replay_is_not(store):
    store.insert_columns(cols(LIVE_RUN, "live", 300, start_ms=T0 + 120_000))
    store.insert_columns(cols(5, "split", 300, start_ms=T0))
    store.record_run(LIVE_RUN, EXP, "live", "running", source="live")
    store.record_run(5, EXP, "split", "running")
    rep = r.build_report(store, info(), q.Filters(EXP))
    assert rep["runs"]["read"] == [
        {"run_id": LIVE_RUN, "status": "running", "mode": "live", "partial": False}
    ]
    assert rep["banners"] == [] and n_read(rep) == 300
    assert rep["runs"]["not_read"] == [
        {"run_id": 5, "status": "running", "mode": "split", "reason": "status"}
    ]
    # A live run that ended badly in the catalog is held back like any other.
    store.record_run(LIVE_RUN, EXP, "live", "failed", source="live")
    assert r.build_report(store, info(), q.Filters(EXP, mode="live"))["runs"]["read"] == []


def test_select_runs_alone_places_live_runs_by_their_samples_mode():
    version = [[1, 100, 0, 1_000], [LIVE_RUN, 50, 0, 2_000]]  # run, rows, sum, newest recorded_ms
    catalog = [{"run_id": 1, "status": "done", "mode": "split"}]
    picked = select_runs(q.Filters(EXP), version, catalog, lambda: {1: "split", LIVE_RUN: "live"})
    assert picked.mode == "live" and picked.runs == (LIVE_RUN,)
    assert picked.info["available_modes"] == {"split": [1]} and picked.banners == []
    asked = select_runs(q.Filters(EXP, run_id=LIVE_RUN), version, catalog, lambda: {LIVE_RUN: "live"})
    assert asked.mode == "live" and asked.info["mode_source"] == "the run asked for"


def not_chosen_by_the_router(run_id: int, n: int, seq_from: int, *, start_ms: float) -> dict:
    """n live requests on the control that the router did not assign: a third without a user
    (revision 0), a third for an experiment without weights (revision 0), a third retried on
    the control after their variant failed (attempt 2, the user's revision kept)."""
    c = cols(run_id, "live", n, start_ms=start_ms)
    k = len(c["mode"])
    c["variant"] = np.full(k, "fp16", dtype=object)
    c["seq"] = c["seq"] + seq_from
    c["request_id"] = np.array([f"gw-extra-{i}" for i in range(k)], dtype=object)
    part = np.arange(k) % 3
    c["user_id"] = np.where(part == 0, "", c["user_id"]).astype(object)
    c["config_revision"] = np.where(part == 2, c["config_revision"], 0).astype(np.uint32)
    c["attempt"] = np.where(part == 2, 2, 1).astype(np.uint8)
    return c


def test_live_traffic_is_tested_for_sample_ratio_mismatch_on_the_routers_assignments_only(store):
    assigned = cols(LIVE_RUN, "live", 3000, start_ms=T0)
    store.insert_columns(assigned)
    # 1,500 more on the control, none of them the router's choice: counted, served, not tested
    store.insert_columns(not_chosen_by_the_router(LIVE_RUN, 1500, 10**6, start_ms=T0))
    rep = r.build_report(store, info(), q.Filters(EXP, mode="live"))
    assert rep["modes"] == {"live": 4500}
    srm = rep["srm"]
    assert srm["applicable"] and not srm["flagged"], srm
    users = {v: int(np.sum(assigned["variant"] == v)) for v in ("fp16", "awq", "awq-fa2")}
    [part] = srm["revisions"]
    assert {v: part["observed"][v] for v in users} == users  # one user per assigned request
    assert rep["anytime"]["srm"]["applicable"] and rep["banners"] == []


def test_a_live_split_that_does_not_match_the_weights_is_flagged(store):
    c = cols(LIVE_RUN, "live", 3000, start_ms=T0)
    keep = (c["variant"] != "awq") | (np.arange(len(c["variant"])) % 2 == 0)  # half of awq's users lost
    store.insert_columns({k: v[keep] for k, v in c.items()})
    rep = r.build_report(store, info(), q.Filters(EXP, mode="live"))
    assert rep["srm"]["flagged"] and rep["banners"][0] == rep["srm"]["message"]


def test_live_traffic_the_router_never_assigned_has_no_srm_and_says_why(store):
    c = not_chosen_by_the_router(LIVE_RUN, 600, 0, start_ms=T0)
    c["attempt"] = np.ones(len(c["attempt"]), dtype=np.uint8)
    c["config_revision"] = np.zeros(len(c["config_revision"]), dtype=np.uint32)
    store.insert_columns(c)
    srm = r.build_report(store, info(), q.Filters(EXP, mode="live"))["srm"]
    assert not srm["applicable"] and "no live request was assigned by the router" in srm["note"]


def test_a_rolled_up_live_run_counts_the_same_assigned_users_as_its_samples(store):
    from analysis import rollup

    store.insert_columns(cols(LIVE_RUN, "live", 1500, start_ms=T0))
    store.insert_columns(not_chosen_by_the_router(LIVE_RUN, 900, 10**6, start_ms=T0))
    store.record_run(LIVE_RUN, EXP, "live", "done", source="live")
    assert rollup.build_run_rollup(store, EXP, LIVE_RUN, info().slo) is not None
    f = q.Filters(EXP, mode="live")
    fast, raw = r.build_report(store, info(), f), r.build_report(store, info(), f, use_rollup=False)
    assert fast["timing"]["source"] == "rollup" and raw["timing"]["source"] == "samples"
    assert fast["srm"]["applicable"] and fast["srm"]["revisions"] == raw["srm"]["revisions"]
