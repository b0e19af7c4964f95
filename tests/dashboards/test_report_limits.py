"""The report's limits: its queries run under a ClickHouse time limit and one past it is a
clear 400 on every surface, and a malformed run id is a 400, not a 500."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from samples import synthetic
from samples.store import QueryTimeout

pytestmark = pytest.mark.django_db

# Billions of rows: seconds of work on either backend, so a 1 s limit always stops it.
# A hash per row: no engine can answer it from the range alone (a plain sum(number) over
# numbers() sometimes returned on chDB within the limit instead of timing out).
ENDLESS = "SELECT count() FROM numbers(10000000000) WHERE sipHash64(number) % 7 = 3"


@pytest.fixture
def loaded(sample_store, experiment):
    spec = synthetic.SyntheticSpec(
        mode="split", n=200, seed=1, run_id=1, duration_s=60.0, variants=synthetic.demo_variants()
    )
    sample_store.insert_columns(synthetic.generate(spec).columns)
    sample_store.record_run(1, "ttft-opt", "split", "done")
    return sample_store


@pytest.mark.parametrize("run", ["²", "١", "1e3", "-1", "99999999999999999999999"])
def test_a_run_that_is_not_a_plain_id_is_a_400_on_every_surface(client, client_for, users, experiment, run):
    client.force_login(users["analyst"])
    page = client.get("/dashboards/ttft-opt/", {"run": run})
    assert page.status_code == 400 and "must be a run id" in page.content.decode()
    assert client.get("/dashboards/ttft-opt/export/variants.csv", {"run": run}).status_code == 400
    api = client_for("analyst").get("/api/experiments/ttft-opt/report", {"run": run})
    assert api.status_code == 400 and "must be a run id" in api.json()["filters"]


def test_a_query_past_its_time_limit_stops_with_query_timeout(sample_store):
    with pytest.raises(QueryTimeout, match="max_execution_time = 1 s"):
        sample_store.query(ENDLESS, settings={"max_execution_time": 1})
    # the store is usable after, and the limit was for that query only
    assert sample_store.query("SELECT 1") == [(1,)]
    assert sample_store.query("SELECT value FROM system.settings WHERE name = 'max_execution_time'") == [
        ("0",)
    ]


def test_query_settings_are_plain_names_and_whole_numbers(sample_store):
    from samples.store import StoreError

    for bad in ({"max_execution_time": 0.5}, {"x; DROP TABLE samples": 1}, {"max_execution_time": True}):
        with pytest.raises(StoreError, match="query setting"):
            sample_store.query("SELECT 1", settings=bad)


def test_every_report_query_carries_the_time_limit(loaded, experiment, settings, monkeypatch):
    from analysis.definitions import Filters
    from dashboards.reports import report_for

    settings.REPORT_MAX_EXECUTION_S = 7
    seen: list = []
    select = loaded._select

    def spy(sql, query_settings=None):
        seen.append(query_settings)
        return select(sql, query_settings)

    monkeypatch.setattr(loaded, "_select", spy)
    report = report_for(experiment, Filters("ttft-opt"), loaded, use_cache=False)
    assert sum(v["n"] for v in report["variants"]) == 200
    limited = [s for s in seen if s]
    assert limited and all(s == {"max_execution_time": 7} for s in limited)
    # only the run catalog (store.runs, a few rows) is read without it
    assert len(seen) - len(limited) <= 1


def test_the_parts_a_report_reads_by_unit_carry_the_time_limit():
    """A cluster's shards (SampleStore.unit_shards), read one by one, keep the report's limit."""
    from analysis.readers.shards import query_by_unit
    from dashboards.reports import TimeLimitedStore

    class Part:
        def __init__(self, name):
            self.name, self.seen = name, []

        def query(self, sql, params=None, *, settings=None):
            self.seen.append((sql, settings))
            return [(self.name,)]

    class Sharded:
        parallel_queries = 2
        parts = [Part("a"), Part("b")]

        def unit_shards(self):
            return [(p.name, p, "samples_local") for p in self.parts]

    store = Sharded()
    got = query_by_unit(TimeLimitedStore(store, 7), lambda table: (f"SELECT 1 FROM {table}", {}))
    assert got == [[("a",)], [("b",)]]
    assert [p.seen for p in store.parts] == [[("SELECT 1 FROM samples_local", {"max_execution_time": 7})]] * 2


def test_a_report_past_its_time_limit_is_a_400_saying_so(
    client, client_for, users, loaded, settings, monkeypatch
):
    settings.REPORT_MAX_EXECUTION_S = 3
    select = loaded._select

    def slow(sql, query_settings=None):
        if query_settings:
            raise QueryTimeout(f"{loaded.describe()}: query stopped after max_execution_time = 3 s")
        return select(sql, query_settings)

    monkeypatch.setattr(loaded, "_select", slow)
    client.force_login(users["analyst"])
    page = client.get("/dashboards/ttft-opt/")
    assert page.status_code == 400
    assert "took longer than 3 s (ABPLAT_REPORT_MAX_EXECUTION_S)" in page.content.decode()
    assert client.get("/dashboards/ttft-opt/export/variants.csv").status_code == 400
    api = client_for("analyst").get("/api/experiments/ttft-opt/report")
    assert api.status_code == 400 and "narrow it" in api.json()["report"]
    with pytest.raises(CommandError, match="took longer than 3 s"):
        call_command("sla_report", "ttft-opt", stdout=io.StringIO())
