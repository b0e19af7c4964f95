"""The report cache (report_for): a repeat is served from the cache only while nothing the
report depends on changed: the samples, the experiment's settings, the filters. One scan of
recorded_ms keys the cache and tells which rollups are current."""

from __future__ import annotations

import dataclasses
import time

import pytest
from django.core.cache import caches

from analysis import definitions as q
from analysis import report as r
from analysis import rollup
from analysis.readers.merged import report_scope
from analysis.readers.raw import RawReader
from analysis.sql import SAMPLES
from dashboards import reports
from samples import synthetic

pytestmark = [pytest.mark.django_db, pytest.mark.services]

FIRST, SECOND = 31, 32


def _data(run_id: int, n: int, seed: int) -> synthetic.Synthetic:
    spec = synthetic.SyntheticSpec(
        run_id=run_id,
        n=n,
        seed=seed,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=600.0,
    )
    return synthetic.generate(spec)


def _numbers(report: dict) -> list[tuple]:
    """Per variant: key, samples, SLO hits and every TTFT percentile with its interval."""
    return [
        (
            v["key"],
            v["n"],
            v["hits"],
            [(p["label"], p["value"], p["lo"], p["hi"]) for p in v["percentiles"]["ttft_ms"]],
        )
        for v in report["variants"]
    ]


@pytest.fixture(autouse=True)
def _empty_cache():
    caches[reports.CACHE_ALIAS].clear()
    yield
    caches[reports.CACHE_ALIAS].clear()


@pytest.fixture
def loaded(sample_store):
    synthetic.insert(sample_store, _data(FIRST, 3000, 1))
    return sample_store


def test_a_repeat_is_a_hit_and_new_samples_are_a_miss(experiment, loaded):
    f = q.Filters("ttft-opt")
    first = reports.report_for(experiment, f, loaded)
    again = reports.report_for(experiment, f, loaded)
    assert (first["timing"]["cache"], again["timing"]["cache"]) == ("miss", "hit")
    assert _numbers(again) == _numbers(first) and again["generated_at"] == first["generated_at"]
    assert sum(v["n"] for v in first["variants"]) == 3000

    synthetic.insert(loaded, _data(SECOND, 500, 2))  # a second run arrives
    grown = reports.report_for(experiment, f, loaded)
    assert grown["timing"]["cache"] == "miss"
    assert sum(v["n"] for v in grown["variants"]) == 3500
    # the run filter is part of the key: the first run alone is its own entry
    alone = reports.report_for(experiment, dataclasses.replace(f, run_id=FIRST), loaded)
    assert alone["timing"]["cache"] == "miss" and sum(v["n"] for v in alone["variants"]) == 3000


def test_deleted_samples_are_a_miss(experiment, loaded):
    synthetic.insert(loaded, _data(SECOND, 500, 2))
    f = q.Filters("ttft-opt")
    assert sum(v["n"] for v in reports.report_for(experiment, f, loaded)["variants"]) == 3500
    loaded.execute(f"ALTER TABLE {SAMPLES} DELETE WHERE run_id = {SECOND}")
    deadline = time.monotonic() + 20  # ALTER ... DELETE is asynchronous on the server
    while [v[0] for v in RawReader(loaded).data_version("ttft-opt")] != [
        FIRST
    ] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = reports.report_for(experiment, f, loaded)
    assert after["timing"]["cache"] == "miss"
    assert sum(v["n"] for v in after["variants"]) == 3000


def test_a_changed_slo_is_a_miss_with_its_own_numbers(experiment, loaded):
    f = q.Filters("ttft-opt")
    strict = reports.report_for(experiment, f, loaded)
    experiment.sla_ttft_ms = 80.0
    experiment.save(update_fields=["sla_ttft_ms"])
    loose = reports.report_for(experiment, f, loaded)
    assert loose["timing"]["cache"] == "miss"
    assert sum(v["hits"] for v in loose["variants"]) < sum(v["hits"] for v in strict["variants"])
    experiment.sla_ttft_ms = 200.0
    experiment.save(update_fields=["sla_ttft_ms"])
    assert reports.report_for(experiment, f, loaded)["timing"]["cache"] == "hit"  # the first entry again


def test_the_one_scan_picks_the_same_rollups_as_a_scan_of_its_own(experiment, loaded):
    """report_for hands the cache key's per-run (rows, sum) to report_scope: with a finished
    run built and a second run still arriving, it chooses what a fresh scan chooses."""
    slo = reports.slo_of(experiment)
    assert rollup.build_run_rollup(loaded, "ttft-opt", FIRST, slo) is not None
    synthetic.insert(loaded, _data(SECOND, 500, 2))  # no rollup: read raw beside the build
    version = RawReader(loaded).data_version("ttft-opt")
    assert [v[:2] for v in version] == [(FIRST, 3000), (SECOND, 500)]
    for f in (
        q.Filters("ttft-opt"),
        q.Filters("ttft-opt", run_id=FIRST),
        q.Filters("ttft-opt", run_id=SECOND),
    ):
        assert report_scope(loaded, f, slo, version) == report_scope(loaded, f, slo)
    rep = reports.report_for(experiment, q.Filters("ttft-opt"), loaded)
    assert rep["timing"]["source"] == "rollup+samples"
    raw = r.build_report(loaded, reports.experiment_info(experiment), q.Filters("ttft-opt"), use_rollup=False)
    assert _numbers(rep) == _numbers(raw)
