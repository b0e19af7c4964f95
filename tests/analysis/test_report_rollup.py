# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The report from per-run rollups equals the report from the raw samples, on both backends,
and falls back to the raw samples whenever a rollup could be out of date."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from analysis import rollup
from analysis.readers.merged import reader_for, report_scope
from analysis.readers.raw import RawReader
from analysis.readers.rollup import RollupReader, series_level
from samples import schema, synthetic
from samples.store import SampleStore
from tests.analysis.fixtures_report import (  # noqa: F401 - fixtures
    SLO,
    assert_same,
    drop_stores,
    info,
    load_stores,
    mirror_data,
    mirror_spec,
    split_data,
    split_spec,
)

pytestmark = pytest.mark.services

SPLIT_RUN, MIRROR_RUN, LIVE_RUN = split_spec().run_id, mirror_spec().run_id, 13


@pytest.fixture(scope="module")
def live_data() -> synthetic.Synthetic:
    """A second run of the split experiment that has no rollup (as if still replaying)."""
    return synthetic.generate(
        dataclasses.replace(
            split_spec(), run_id=LIVE_RUN, n=6_000, seed=8, duplicate_rate=0.0, config_revisions=(102,)
        )
    )


@pytest.fixture(scope="module")
def stores(
    chdb_dir: str, clickhouse_server: str, split_data, mirror_data, live_data
) -> Iterator[dict[str, SampleStore]]:
    """Own databases (the shared report fixtures stay on the raw path), rollups built for the
    split and mirror runs, not for the live run."""
    out = load_stores(chdb_dir, "abplat_test_rollup", (split_data, mirror_data, live_data))
    for store in out.values():
        for data in (split_data, mirror_data):
            spec = data.spec
            built = rollup.build_run_rollup(store, spec.experiment, spec.run_id, SLO)
            assert built is not None and built.rows == int((~data.is_duplicate).sum())
    yield out
    drop_stores(out)


@pytest.fixture(params=["chdb", "server"])
def store(request: pytest.FixtureRequest, stores) -> SampleStore:
    return stores[request.param]


@pytest.mark.parametrize(
    "spec_fn, filters, source",
    [
        (split_spec, {"run_id": SPLIT_RUN}, "rollup"),
        (split_spec, {"run_id": SPLIT_RUN, "variants": ("awq",)}, "rollup"),
        (split_spec, {}, "rollup+samples"),  # the rolled-up run and the live one
        (split_spec, {"variants": ("awq",)}, "rollup+samples"),
        (split_spec, {"run_id": LIVE_RUN}, "samples"),
        (mirror_spec, {}, "rollup"),
    ],
    ids=["run", "run-variant", "mixed", "mixed-variant", "live-run", "mirror"],
)
def test_rollup_report_equals_raw_report(store, spec_fn, filters, source):
    spec = spec_fn()
    exp = info(spec)
    f = q.Filters(spec.experiment, **filters)
    fast = r.build_report(store, exp, f)
    raw = r.build_report(store, exp, f, use_rollup=False)
    assert fast["timing"]["source"] == source
    assert raw["timing"]["source"] == "samples"
    assert fast["variants"][0]["n"] > 0
    assert_same(raw, fast)


def test_the_scope_names_the_runs_read_from_rollups_and_from_samples(store):
    scope = report_scope(store, q.Filters(split_spec().experiment), SLO)
    assert set(scope.builds) == {SPLIT_RUN} and scope.live == (LIVE_RUN,)
    assert report_scope(store, q.Filters(split_spec().experiment, run_id=LIVE_RUN), SLO) is None


def test_p99_chart_from_rollup_is_within_its_1ms_bucket_and_counts_match(store):
    spec = split_spec()
    f = q.Filters(spec.experiment, run_id=SPLIT_RUN)
    builds = report_scope(store, f, SLO).builds
    assert list(builds) == [SPLIT_RUN]
    # 20: re-grouped from the 10 s rows; the others: each from its own coarser level
    for bucket_s in (20, 30, 60, 300, 900, 3600):
        exact = RawReader(store).p99_over_time(f, bucket_s)
        fast = RollupReader(store, builds).p99_over_time(f, bucket_s)
        assert set(exact) == set(fast)
        for v in exact:
            assert [(t, n) for t, n, _ in exact[v]] == [(t, n) for t, n, _ in fast[v]]
            for (_, _, e), (_, _, g) in zip(exact[v], fast[v], strict=True):
                assert math.floor(e) == math.floor(g) and g >= e


def test_the_chart_reads_the_coarsest_level_dividing_its_bucket():
    assert q.SERIES_LEVELS_S[0] > q.GRAIN_S
    for finer, coarser in zip((q.GRAIN_S, *q.SERIES_LEVELS_S), q.SERIES_LEVELS_S, strict=False):
        assert coarser % finer == 0, (finer, coarser)
    assert [series_level(b) for b in (10, 20, 30, 90, 120, 600, 3600, 7200, 86400, 172800)] == [
        10,
        10,
        30,
        30,
        60,
        300,
        3600,
        3600,
        86400,
        86400,
    ]


def test_a_report_from_rollups_reads_the_samples_only_for_their_signature(store, monkeypatch):
    """Failures, setup errors and the chart come from the rollup too: once a run is built, the
    only passes over its samples are the staleness check (count and recorded sum per run) and,
    for runs without a catalog row, their modes."""
    spec = split_spec()
    seen: list[str] = []
    real = type(store).query

    def query(self, sql, *a, **kw):
        seen.append(sql)
        return real(self, sql, *a, **kw)

    monkeypatch.setattr(type(store), "query", query)
    rep = r.build_report(store, info(spec), q.Filters(spec.experiment, run_id=SPLIT_RUN))
    assert rep["timing"]["source"] == "rollup"
    assert sum(c["n"] for v in rep["variants"] for c in v["failures"].values()) > 0
    on_samples = [sql for sql in seen if re.search(rf"\bFROM {schema.SAMPLES_TABLE}\b", sql)]
    # the signature, and the modes of these runs, which have no catalog row (analysis.runs)
    assert len(on_samples) == 2, on_samples
    assert "sum(recorded_ms)" in on_samples[0] and "GROUP BY run_id, mode" in on_samples[1], on_samples


def test_failure_classes_from_rollups_and_live_runs_add_up(store):
    spec = split_spec()
    f = q.Filters(spec.experiment)  # the built run and the live one
    merged = reader_for(store, f, SLO)
    assert merged.source == "rollup+samples"
    raw = RawReader(store)
    assert merged.failures(f) == raw.failures(f)
    assert merged.setup_errors(f) == raw.setup_errors(f)
    one = raw.failures(q.Filters(spec.experiment, run_id=SPLIT_RUN))
    live = raw.failures(q.Filters(spec.experiment, run_id=LIVE_RUN))
    for v, classes in merged.failures(f).items():
        for outcome, entry in classes.items():
            both = one.get(v, {}).get(outcome, {}).get("n", 0) + live.get(v, {}).get(outcome, {}).get("n", 0)
            assert entry["n"] == both > 0


def test_a_time_window_or_another_slo_reads_the_raw_samples(store):
    spec = split_spec()
    start = dt.datetime.fromtimestamp(spec.start_unix_ms / 1000, dt.UTC)
    window = q.Filters(spec.experiment, since=start, until=start + dt.timedelta(minutes=10))
    assert report_scope(store, window, SLO) is None
    assert r.build_report(store, info(spec), window)["timing"]["source"] == "samples"
    other = q.Slo(250.0)
    assert report_scope(store, q.Filters(spec.experiment), other) is None
    rep = r.build_report(store, info(spec, slo=other), q.Filters(spec.experiment))
    assert rep["timing"]["source"] == "samples"


def test_srm_over_several_runs_counts_users_on_the_raw_samples(store):
    # one build per run but two runs: per-run distinct users do not add up
    builds = {1: 1, 2: 2}
    assert RollupReader(store, builds).srm_users(q.Filters("x")) is None


@pytest.mark.parametrize("kind", ["chdb", "server"])
def test_a_row_added_after_the_build_sends_the_report_back_to_the_samples(kind, shared_store):
    store = shared_store(kind)  # the session's migrated database, empty (tests/sample_dbs.py)
    spec = synthetic.SyntheticSpec(n=2_000, seed=3, run_id=5, variants=synthetic.demo_variants())
    data = synthetic.generate(spec)
    synthetic.insert(store, data)
    store.deduplicate()
    first = rollup.build_run_rollup(store, spec.experiment, 5, SLO)
    assert first is not None
    f = q.Filters(spec.experiment)
    assert report_scope(store, f, SLO) is not None
    late = synthetic.generate(dataclasses.replace(spec, n=1, seed=99))
    late.columns["request_id"] = np.array([f"{x}-late" for x in late.columns["request_id"]], dtype=object)
    synthetic.insert(store, late)
    assert report_scope(store, f, SLO) is None
    rep = r.build_report(store, info(spec), f)
    assert rep["timing"]["source"] == "samples"
    assert sum(v["n"] for v in rep["variants"]) == 2_001
    # a rebuild makes the rollup current again, with the late row
    second = rollup.build_run_rollup(store, spec.experiment, 5, SLO)
    assert second.rows == 2_001 and second.build_id > first.build_id
    rep2 = r.build_report(store, info(spec), f)
    assert rep2["timing"]["source"] == "rollup"
    assert_same(rep, rep2)
    # the first build's rows are deleted (ALTER ... DELETE: asynchronous on the server)
    deadline = time.monotonic() + 20
    while True:
        left = [
            store.query(f"SELECT count() FROM {t} WHERE build_id = %(b)s", {"b": first.build_id})[0][0]
            for t in (*schema.ROLLUP_TABLES, schema.ROLLUP_VALUES_TABLE)
        ]
        if not any(left) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == [0] * len(left)
    assert (
        store.query(
            f"SELECT count() FROM {schema.ROLLUP_VALUES_TABLE} WHERE build_id = %(b)s", {"b": second.build_id}
        )[0][0]
        > 0
    )
    # a run without samples has nothing to build
    assert rollup.build_run_rollup(store, spec.experiment, 6, SLO) is None


def test_a_build_racing_new_samples_publishes_nothing(store, monkeypatch):
    spec = split_spec()
    before = report_scope(store, q.Filters(spec.experiment), SLO)
    real = rollup._signature
    calls = iter(range(10))

    def changing(st, experiment, run_id=None):
        out = real(st, experiment, run_id)
        if next(calls) == 1:  # the check after the build sees one more row
            out = {k: (n + 1, s) for k, (n, s) in out.items()}
        return out

    monkeypatch.setattr(rollup, "_signature", changing)
    with pytest.raises(rollup.RollupStale, match="samples changed during the rollup build"):
        rollup.build_run_rollup(store, spec.experiment, SPLIT_RUN, SLO)
    monkeypatch.setattr(rollup, "_signature", real)
    assert report_scope(store, q.Filters(spec.experiment), SLO) == before


def test_bad_run_id_is_refused(store):
    with pytest.raises(ValueError, match="run_id must be a non-negative integer"):
        rollup.build_run_rollup(store, "x", -1, SLO)


def test_a_build_of_another_rollup_format_is_not_used(store, monkeypatch):
    f = q.Filters(split_spec().experiment)
    assert report_scope(store, f, SLO) is not None
    monkeypatch.setattr(q, "FORMAT_VERSION", q.FORMAT_VERSION + 1)
    assert q.build_spec(SLO).startswith(f"v{q.FORMAT_VERSION}|")
    assert report_scope(store, f, SLO) is None
