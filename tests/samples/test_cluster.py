"""The sample store on a two-shard ClickHouse cluster (scripts/clickhouse_cluster.sh).

Migrations make every table of samples.schema on both servers as `<table>_local` plus a
Distributed `<table>`; inserts spread over both shards (the samples by user, the other tables by
their sorting key), so a retried insert stays exactly once; the report read through the cluster
equals the report of the same samples on one server, and so do the per-user moments read shard
by shard, or through the Distributed table of a cluster sharded the older way. The cluster is the servers of ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS (entry first),
named ABPLAT_TEST_CLICKHOUSE_CLUSTER in their remote_servers config.
"""

from __future__ import annotations

import io
import math
import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from django.core.management import call_command

from analysis import definitions as q
from analysis import report as r
from analysis import rollup, units
from analysis.readers.raw import RawReader
from rollouts.controller import Plan
from rollouts.readings import read_step
from samples import cluster, factory, schema, synthetic
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.backends.cluster import ClickHouseClusterBackend
from samples.store import NotMigrated, SchemaMismatch, StoreError, StoreUnavailable
from tests.plugin import SERVER_URL, server_url_for
from tests.samples.truncate import truncate_for_tests

pytestmark = pytest.mark.services

CLUSTER = os.environ.get("ABPLAT_TEST_CLICKHOUSE_CLUSTER", "abplat_test_cluster")
CLUSTER_URLS = [
    u.strip()
    for u in os.environ.get(
        "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS",
        "clickhouse://default:@127.0.0.1:19101/abplat_test,clickhouse://default:@127.0.0.1:19102/abplat_test",
    ).split(",")
    if u.strip()
]
# Named per test process: two sessions (or pytest-xdist processes) share the servers.
_SUFFIX = uuid.uuid4().hex[:8]
CLUSTER_DB = f"abplat_test_cluster_{_SUFFIX}"
SINGLE_DB = f"abplat_test_single_{_SUFFIX}"
VERSIONS = [m.version for m in schema.MIGRATIONS]


def _drop(url: str, database: str, recreate: bool = False) -> None:
    admin = ClickHouseServerBackend(server_url_for("default", url), tries=1)
    try:
        admin.execute(f"DROP DATABASE IF EXISTS {database}")
        if recreate:  # empty, but there: it may be the suite's own (ABPLAT_TEST_CLICKHOUSE_URL)
            admin.execute(f"CREATE DATABASE {database}")
    finally:
        admin.close()


@pytest.fixture(scope="module")
def cluster_urls() -> list[str]:
    """The cluster's servers, checked: each answers, and the first one's system.clusters lists
    exactly them under CLUSTER. Fails (never skips) naming the script that starts them."""
    start = "Start it with: scripts/clickhouse_cluster.sh start (scripts/services.sh start does)"
    ports = []
    for url in CLUSTER_URLS:
        probe = ClickHouseServerBackend(server_url_for("default", url), tries=1)
        try:
            probe.ping()
        except StoreError as e:
            pytest.fail(f"cluster server {url} not reachable ({e}). {start}", pytrace=False)
        finally:
            probe.close()
        ports.append(urllib.parse.urlsplit(url).port)
    entry = ClickHouseServerBackend(server_url_for("default", CLUSTER_URLS[0]), tries=1)
    listed = entry.query(
        "SELECT port FROM system.clusters WHERE cluster = %(c)s ORDER BY shard_num", {"c": CLUSTER}
    )
    entry.close()
    if [p for (p,) in listed] != ports or len(ports) < 2:
        pytest.fail(
            f"{CLUSTER_URLS[0]}: cluster {CLUSTER} lists ports {[p for (p,) in listed]}, not the "
            f"two or more servers of ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS ({ports}). {start}",
            pytrace=False,
        )
    return CLUSTER_URLS


@pytest.fixture
def servers(cluster_urls) -> Iterator[list[ClickHouseServerBackend]]:
    """Each server of the cluster, reached directly, on the test database (emptied first)."""
    for url in cluster_urls:
        _drop(url, CLUSTER_DB)
    direct = [ClickHouseServerBackend(server_url_for(CLUSTER_DB, url)) for url in cluster_urls]
    yield direct
    for store in direct:
        store.close()
    for url in cluster_urls:
        _drop(url, CLUSTER_DB)


@pytest.fixture
def cstore(servers, cluster_urls) -> Iterator[ClickHouseClusterBackend]:
    """The sample store through the cluster (entry: the first server), not migrated yet."""
    store = ClickHouseClusterBackend(server_url_for(CLUSTER_DB, cluster_urls[0]), CLUSTER)
    yield store
    store.close()


@pytest.fixture
def single(clickhouse_server) -> Iterator[ClickHouseServerBackend]:
    """One ClickHouse server (the suite's), on its own test database, not migrated yet."""
    _drop(SERVER_URL, SINGLE_DB, recreate=True)
    store = ClickHouseServerBackend(server_url_for(SINGLE_DB), send_receive_timeout=120)
    yield store
    store.close()
    _drop(SERVER_URL, SINGLE_DB)


def local_rows(servers, table: str = schema.SAMPLES_TABLE) -> list[int]:
    return [int(s.query(f"SELECT count() FROM {cluster.local_name(table)}")[0][0]) for s in servers]


# ---- migrations --------------------------------------------------------------------------------


def test_migrations_make_local_and_distributed_tables_on_every_server(cstore, servers):
    assert cstore.migrate() == VERSIONS
    declared = {t: schema.table_columns(t) for m in schema.MIGRATIONS for t in schema.declared_tables(m)}
    assert set(cluster.distributed_tables()) == set(declared)  # every table, whoever added it
    # columns added by ALTER TABLE (migration 5), on the local and the Distributed table alike
    assert ("itl_gaps_us", "Array(UInt32)") in declared[schema.SAMPLES_TABLE]
    for server in servers:
        tables = dict(
            server.query(
                "SELECT name, engine_full FROM system.tables WHERE database = %(db)s", {"db": CLUSTER_DB}
            )
        )
        for table, cols in declared.items():
            local = cluster.local_name(table)
            assert tables[table].startswith(f"Distributed({CLUSTER}, {CLUSTER_DB}, {local}, sipHash64("), (
                table
            )
            assert "MergeTree" in tables[local], (local, tables[local])
            for name in (table, local):
                got = server.query(
                    "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                    {"db": CLUSTER_DB, "t": name},
                )
                assert got == cols, name
        # the migration record is each server's own
        assert tables[schema.MIGRATIONS_TABLE].startswith("MergeTree")
        assert [
            v for (v,) in server.query(f"SELECT version FROM {schema.MIGRATIONS_TABLE} ORDER BY version")
        ] == VERSIONS
    assert all(m["applied"] and m["checksum_ok"] for m in cstore.migration_status())


def test_migrate_is_idempotent_and_repairs_one_server(cstore, servers):
    assert cstore.migrate() == VERSIONS
    assert cstore.migrate() == []
    servers[1].execute(f"DROP TABLE {cluster.local_name(schema.SAMPLES_TABLE)}")
    # the second server's local samples table was gone: re-created (1), then its columns added
    # (5, 7, 8, 9)
    assert cstore.migrate() == [1, 5, 7, 8, 9]
    local_columns = servers[1].query(
        "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = 'samples_local'",
        {"db": CLUSTER_DB},
    )
    assert {
        ("itl_gaps_us", "Array(UInt32)"),
        ("output_fp", "UInt64"),
        ("token_fps", "Array(UInt32)"),
        ("answer_text", "String"),
    } <= set(local_columns)
    assert cstore.migrate() == []
    assert local_rows(servers) == [0, 0]
    records = [s.query(f"SELECT count() FROM {schema.MIGRATIONS_TABLE}") for s in servers]
    assert records == [[(len(VERSIONS),)]] * len(servers)  # recorded once, not again


def _rows_of_older_code(cstore, servers, monkeypatch, migrated: int, columns: str, values: str) -> list[int]:
    """The cluster as the code of migration ``migrated`` left it, with 40 rows of run 1 (seq
    0-39) whose ``columns`` beyond their identity take ``values`` (SQL; ``number`` is the seq),
    spread over both servers; returns each server's local row count."""
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:migrated])
        assert cstore.migrate() == VERSIONS[:migrated]
    cstore.execute(
        f"INSERT INTO samples (experiment, variant, run_id, seq, request_id, recorded_ms, sent_at, {columns}) "
        "SELECT 'e', 'v', 1, number, concat('r1-', toString(number)), 1, toDateTime(1732900000, 'UTC'), "
        f"{values} FROM system.numbers LIMIT 40"
    )
    before = local_rows(servers)
    assert sum(before) == 40 and min(before) > 0
    return before


def test_migration_7_adds_gateway_ms_on_every_server_and_keeps_the_rows(
    cstore, servers, make_rows, monkeypatch
):
    before = _rows_of_older_code(
        cstore, servers, monkeypatch, 6, "mode, schedule_lag_ms, outcome", "'split', 1.5, 'ok'"
    )
    assert cstore.migrate() == [7, 8, 9, 10, 11, 12]  # and every migration after it
    assert local_rows(servers) == before  # every row where it was
    for server in servers:
        for table in ("samples", "samples_local"):
            got = dict(
                server.query(
                    "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                    {"db": CLUSTER_DB, "t": table},
                )
            )
            assert got["gateway_ms"] == "Float64", (server.url_safe, table)
            assert (got["output_fp"], got["token_fps"]) == ("UInt64", "Array(UInt32)"), (
                server.url_safe,
                table,
            )
    assert cstore.query("SELECT count(), sum(gateway_ms), sum(schedule_lag_ms) FROM samples") == [
        (40, 0.0, 60.0)
    ]
    live = make_rows(10, mode="live", run_id=10**12 + 1, schedule_lag_ms=0.0, gateway_ms=0.5)
    assert cstore.insert_samples(live) == 10
    assert cstore.query("SELECT sum(gateway_ms) FROM samples WHERE mode = 'live'") == [(5.0,)]
    assert cstore.migrate() == []


def test_migration_9_adds_answer_text_on_every_server_and_keeps_the_rows(
    cstore, servers, make_rows, monkeypatch
):
    before = _rows_of_older_code(
        cstore,
        servers,
        monkeypatch,
        8,
        "mode, outcome, output_fp, token_fps",
        "'mirror', 'ok', number + 1, [toUInt32(number)]",
    )
    assert cstore.migrate() == [9, 10, 11, 12]  # and the tables after it
    assert local_rows(servers) == before  # every row where it was
    for server in servers:
        for table in ("samples", "samples_local"):
            names = [
                n
                for (n,) in server.query(
                    "SELECT name FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                    {"db": CLUSTER_DB, "t": table},
                )
            ]
            assert names.index("answer_text") == names.index("token_fps") + 1, (server.url_safe, table)
    assert cstore.query("SELECT count(), sum(output_fp), countIf(answer_text != '') FROM samples") == [
        (40, 820, 0)
    ]
    rows = make_rows(10, mode="mirror", run_id=2)
    assert cstore.insert_samples(rows) == 10
    assert cstore.query("SELECT seq, answer_text FROM samples WHERE run_id = 2 ORDER BY seq") == [
        (r["seq"], r["answer_text"]) for r in rows
    ]
    assert cstore.migrate() == []


def test_the_migrate_command_migrates_the_cluster(cstore, servers, settings, cluster_urls):
    settings.CLICKHOUSE_URL = server_url_for(CLUSTER_DB, cluster_urls[0])
    settings.CLICKHOUSE_CLUSTER = CLUSTER
    factory._cache.clear()
    try:
        for expect in ("applied 0001", "no migrations to apply"):
            out = io.StringIO()
            call_command("clickhouse_migrate", stdout=out)
            assert expect in out.getvalue() and f"clickhouse-cluster {CLUSTER}" in out.getvalue()
    finally:
        factory._cache.clear()
    assert all(m["applied"] for m in cstore.migration_status())


def test_a_database_is_either_a_clusters_or_one_servers(cstore, servers, cluster_urls):
    cstore.migrate()
    plain = ClickHouseServerBackend(server_url_for(CLUSTER_DB, cluster_urls[0]))
    with pytest.raises(SchemaMismatch, match="is a Distributed table .* no ABPLAT_CLICKHOUSE_CLUSTER is set"):
        plain.migrate()
    plain.close()
    for url in cluster_urls:
        _drop(url, CLUSTER_DB)
    plain = ClickHouseServerBackend(server_url_for(CLUSTER_DB, cluster_urls[0]))
    plain.migrate()
    plain.close()
    with pytest.raises(
        SchemaMismatch, match=f"ABPLAT_CLICKHOUSE_CLUSTER={CLUSTER} expects a Distributed table"
    ):
        ClickHouseClusterBackend(server_url_for(CLUSTER_DB, cluster_urls[0]), CLUSTER).migrate()


def test_an_unknown_cluster_is_an_error_naming_the_known_ones(cluster_urls):
    store = ClickHouseClusterBackend(server_url_for(CLUSTER_DB, cluster_urls[0]), "no_such_cluster")
    with pytest.raises(
        StoreError, match=rf"ABPLAT_CLICKHOUSE_CLUSTER=no_such_cluster: .* \(it has: {CLUSTER}\)"
    ):
        store.migrate()


def test_a_server_not_migrated_fails_the_schema_check_naming_it(cstore, servers, cluster_urls):
    cstore.migrate()
    servers[1].execute(f"DROP TABLE {schema.MIGRATIONS_TABLE}")
    fresh = ClickHouseClusterBackend(server_url_for(CLUSTER_DB, cluster_urls[0]), CLUSTER)
    lacks = rf"not migrated on every server: {servers[1].url_safe} lacks 0001, 0002, 0003"
    with pytest.raises(NotMigrated, match=lacks) as err:
        fresh.check_schema()
    assert "Run `python manage.py migrate`" in str(err.value)
    # a query that meets the missing table says the same, not the shard's raw error
    servers[1].execute(f"DROP TABLE {cluster.local_name(schema.SAMPLES_TABLE)}")
    with pytest.raises(NotMigrated, match=lacks) as err:
        fresh.count(1)
    assert f"There is no table {CLUSTER_DB}.samples_local" in str(err.value.__cause__)
    cstore.migrate()
    fresh.check_schema()
    assert fresh.count(1) == 0


# ---- inserts and exactly-once ------------------------------------------------------------------


def test_inserts_land_on_both_shards_and_a_retry_stays_exactly_once(cstore, servers, make_rows):
    cstore.migrate()
    rows = make_rows(200)
    assert cstore.insert_samples(rows) == 200
    first = local_rows(servers)
    assert sum(first) == 200 and min(first) > 0, first  # both shards hold some
    # read right after the insert: insert_distributed_sync, nothing waits in a queue
    assert cstore.count(7) == 200
    # a retry of the same batch (a lost reply), some rows recorded again later with another result
    assert cstore.insert_samples(rows) == 200
    later = make_rows(20, recorded_ms=1_732_900_009_000, error="recorded again")
    cstore.insert_samples(later)
    assert sum(local_rows(servers)) == 420
    assert cstore.count(7) == 200  # one per request, however many copies
    assert cstore.query(f"SELECT count() FROM {schema.SAMPLES_FROM}") == [(200,)]
    assert cstore.query(
        f"SELECT countIf(error = 'recorded again') FROM {schema.SAMPLES_FROM} WHERE seq < 20"
    ) == [(20,)]  # the newest recording wins, through the Distributed table
    # every copy of a request is on one shard: the shards' request ids are disjoint
    ids = [set(r for (r,) in s.query("SELECT DISTINCT request_id FROM samples_local")) for s in servers]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 200
    assert [len(i) for i in ids] == first
    # the dedup step works shard by shard and leaves one row per request on disk
    assert cstore.deduplicate(7) == 220
    assert local_rows(servers) == first
    assert cstore.recorded_request_ids(7) == {row["request_id"] for row in rows}


def test_run_catalog_and_truncate_through_the_cluster(cstore, servers, make_rows):
    cstore.migrate()
    for run in range(1, 9):
        cstore.record_run(run, "exp", "split", "running", started_ms=run)
        cstore.record_run(run, "exp", "split", "done", started_ms=run, finished_ms=run + 1)
    cstore.record_run(3, "exp", "split", "running", started_ms=3)  # a late retry: done stays
    assert [(x["run_id"], x["status"], x["finished_ms"]) for x in cstore.runs("exp")] == [
        (run, "done", run + 1) for run in range(1, 9)
    ]
    assert min(local_rows(servers, schema.RUNS_TABLE)) > 0
    cstore.insert_samples(make_rows(50))
    truncate_for_tests(cstore)  # a Distributed table ignores TRUNCATE: it runs on every shard
    assert local_rows(servers) == [0, 0] and local_rows(servers, schema.RUNS_TABLE) == [0, 0]


# ---- the report ----------------------------------------------------------------------------------


def assert_same_numbers(a, b, path: str = "") -> None:
    """Equal report JSON. Floats to 1e-12 relative: a mean sums its values in another order on
    two shards than on one server (as it does across the threads of one server); counts, hits,
    ranks and the exact quantiles (values of samples) are compared exactly all the same."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys differ"
        for k in a.keys() - {"timing", "generated_at"}:
            assert_same_numbers(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_numbers(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and not (math.isnan(a) and math.isnan(b)):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), f"{path}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b) and (a == b or a != a), f"{path}: {a!r} != {b!r}"


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


class SpyStore:
    """A store whose reads are noted (their SQL) and then run."""

    def __init__(self, store, sent: list[str]) -> None:
        self._store, self._sent = store, sent

    def query(self, sql, params=None, **kw):
        self._sent.append(sql)
        return self._store.query(sql, params, **kw)

    def query_columns(self, sql, params=None, **kw):
        self._sent.append(sql)
        return self._store.query_columns(sql, params, **kw)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_the_report_through_the_cluster_equals_one_servers(cstore, servers, single):
    common = dict(variants=synthetic.demo_variants(), factor_effects=synthetic.DEMO_FACTOR_EFFECTS)
    specs = [
        synthetic.SyntheticSpec(
            n=6_000,
            seed=6,
            run_id=11,
            config_revisions=(101, 102),
            duplicate_rate=0.02,
            duration_s=900.0,
            **common,
        ),
        # mirror mode: the report pairs control and variant rows (a JOIN of two subqueries)
        synthetic.SyntheticSpec(
            experiment="ttft-mirror",
            mode="mirror",
            n=800,
            seed=7,
            run_id=12,
            duplicate_rate=0.02,
            duration_s=300.0,
            **common,
        ),
    ]
    datasets = [synthetic.generate(spec) for spec in specs]
    exps = [
        r.ExperimentInfo(
            key=spec.experiment,
            name=spec.experiment,
            slo=q.Slo(200.0),
            target=0.9,
            variants=[r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in spec.variants],
        )
        for spec in specs
    ]
    reports: dict[str, list] = {}
    sent: dict[str, list[str]] = {"single": [], "cluster": []}
    for name, store in (("single", single), ("cluster", cstore)):
        store.migrate()
        for data in datasets:
            synthetic.insert(store, data)
        assert 0 <= store.deduplicate() <= sum(int(d.is_duplicate.sum()) for d in datasets)
        for spec, exp in zip(specs, exps, strict=True):
            store.record_run(spec.run_id, spec.experiment, spec.mode, "done")
            raw = r.build_report(
                SpyStore(store, sent[name]), exp, q.Filters(spec.experiment), use_rollup=False
            )
            rollup.build_run_rollup(store, spec.experiment, spec.run_id, exp.slo)
            fast = r.build_report(store, exp, q.Filters(spec.experiment))
            assert (raw["timing"]["source"], fast["timing"]["source"]) == ("samples", "rollup")
            reports.setdefault(name, []).append((raw, fast))
    expected_rows = sum(len(d.latest()["seq"]) for d in datasets)
    assert min(local_rows(servers)) > 0 and sum(local_rows(servers)) == expected_rows
    assert min(local_rows(servers, schema.ROLLUP_VALUES_TABLE)) > 0  # rollups are spread too
    assert sum(v["n"] for v in reports["cluster"][0][1]["variants"]) == specs[0].n
    for (one_raw, one_fast), (many_raw, many_fast) in zip(reports["single"], reports["cluster"], strict=True):
        assert_same_numbers(one_raw, many_raw)
        assert_same_numbers(one_fast, many_fast)
    # one server ranks the other metrics with quantilesExact; through a Distributed table that
    # would ship every value to the entry, so the cluster ranks every metric through its histogram
    assert any("quantilesExact" in sql for sql in sent["single"])
    assert not any("quantilesExact" in sql for sql in sent["cluster"])
    # a rebuild deletes the older build's rows on every shard (ALTER ... DELETE per local table)
    spec, exp = specs[0], exps[0]
    rollup.build_run_rollup(cstore, spec.experiment, spec.run_id, exp.slo)
    wait_until(
        lambda: (
            rollup.rollup_rows(cstore, spec.experiment, current_only=False)
            == rollup.rollup_rows(cstore, spec.experiment)
        )
    )
    assert_same_numbers(reports["single"][0][1], r.build_report(cstore, exp, q.Filters(spec.experiment)))


# ---- a replay ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_an_eager_replay_writes_to_both_shards_exactly_once(
    running, servers, settings, cluster_urls, tmp_path
):
    from dashboards import reports
    from workers.models import ReplayRun

    settings.CLICKHOUSE_URL = server_url_for(CLUSTER_DB, cluster_urls[0])
    settings.CLICKHOUSE_CLUSTER = CLUSTER
    settings.SPOOL_DIR = tmp_path / "spool"
    factory._cache.clear()
    try:
        call_command("migrate", verbosity=0)  # the Django database and the cluster's tables
        out = io.StringIO()
        call_command(
            "replay",
            "ttft-opt",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "120",
            "--speed",
            "200",
            stdout=out,
        )
        run = ReplayRun.objects.get()
        assert run.status == "done", (run.error, out.getvalue())
        store = factory.sample_store()
        assert run.samples_recorded == 120 == store.count(run.pk)
        per_shard = local_rows(servers)
        assert sum(per_shard) == 120 and min(per_shard) > 0, per_shard
        exp = reports.experiment_info(running)
        fast = reports.build_report(store, exp, q.Filters("ttft-opt"))
        raw = reports.build_report(store, exp, q.Filters("ttft-opt"), use_rollup=False)
        assert fast["timing"]["source"] == "rollup"  # built at the run's end, through the cluster
        assert [(v["key"], v["n"], v["hits"]) for v in fast["variants"]] == [
            (v["key"], v["n"], v["hits"]) for v in raw["variants"]
        ]
        assert sum(v["n"] for v in fast["variants"]) == 120
    finally:
        factory._cache.clear()


# ---- the cluster form of a statement (pure) ------------------------------------------------------


def test_every_create_becomes_a_local_table_and_a_distributed_one_sharded_by_its_sorting_key():
    stmts = cluster.server_statements(schema.CREATE_SAMPLES_TABLE, "c1", "db")
    assert stmts[0] == schema.CREATE_SAMPLES_TABLE.replace(
        "CREATE TABLE IF NOT EXISTS samples (", "CREATE TABLE IF NOT EXISTS samples_local (", 1
    )
    # the samples by their unit (analysis.units.CLUSTER_KEY within one experiment), the rest by
    # their sorting key
    assert stmts[1] == (
        "CREATE TABLE IF NOT EXISTS samples AS samples_local ENGINE = Distributed(c1, db, samples_local, "
        "sipHash64(experiment, variant, user_id, if(user_id = '', request_id, '')))"
    )
    assert cluster.SAMPLES_SHARDING_KEY == "sipHash64(experiment, " + units.CLUSTER_KEY.split("(", 1)[1]
    assert cluster.sharding_key(schema.CREATE_RUNS) == "sipHash64(experiment, run_id)"
    table = "CREATE TABLE IF NOT EXISTS t (\n    a UInt8\n)\nENGINE = MergeTree\nORDER BY "
    assert cluster.sharding_key(table + "a") == "sipHash64(a)"
    assert cluster.sharding_key(table + "(a, intDiv(b, 10))") == "sipHash64(a, intDiv(b, 10))"
    assert cluster.sharding_key(table + "tuple()") == "rand()"  # no key, nothing to dedupe
    with pytest.raises(cluster.ClusterSchemaError, match="no ORDER BY"):
        cluster.sharding_key("CREATE TABLE IF NOT EXISTS t (\n    a UInt8\n)\nENGINE = Log")
    assert cluster.server_statements("ALTER TABLE samples ADD COLUMN x UInt8", "c1", "db") == (
        "ALTER TABLE samples_local ADD COLUMN x UInt8",
        "ALTER TABLE samples ADD COLUMN x UInt8",
    )
    with pytest.raises(cluster.ClusterSchemaError, match="INSERT INTO samples .* has no cluster form"):
        cluster.server_statements("INSERT INTO samples SELECT 1", "c1", "db")


def test_the_samples_sharding_key_is_told_apart_from_the_older_one():
    ours = cluster.server_statements(schema.CREATE_SAMPLES_TABLE, "c1", "db")[1].split("ENGINE = ", 1)[1]
    assert cluster.sharded_by_unit(ours)
    assert cluster.sharded_by_unit(ours.replace(", ", ",  "))  # whitespace aside
    older = "Distributed(c1, db, samples_local, sipHash64(experiment, variant, run_id, seq, request_id))"
    assert not cluster.sharded_by_unit(older)
    assert not cluster.sharded_by_unit("ReplacingMergeTree(recorded_ms) ORDER BY (experiment)")
    assert not cluster.sharded_by_unit("")


def test_what_a_distributed_table_refuses_runs_on_the_local_tables():
    tables = cluster.distributed_tables()
    assert cluster.per_shard_form("OPTIMIZE TABLE samples PARTITION 202411 FINAL", tables) == (
        "OPTIMIZE TABLE samples_local PARTITION 202411 FINAL"
    )
    assert (
        cluster.per_shard_form("TRUNCATE TABLE IF EXISTS runs", tables)
        == "TRUNCATE TABLE IF EXISTS runs_local"
    )
    assert cluster.per_shard_form("ALTER TABLE rollup_hist DELETE WHERE run_id = 1", tables) == (
        "ALTER TABLE rollup_hist_local DELETE WHERE run_id = 1"
    )
    for sql in (
        "ALTER TABLE samples ADD COLUMN x UInt8",  # a column change: the Distributed table takes it
        "OPTIMIZE TABLE other FINAL",  # not one of ours
        "SELECT * FROM samples",
        "INSERT INTO samples SELECT * FROM samples",
    ):
        assert cluster.per_shard_form(sql, tables) is None, sql


def test_migration_10_creates_the_fidelity_tables_on_every_server_and_spreads_their_rows(cstore, servers):
    cstore.migrate()
    for server in servers:
        tables = {
            n
            for (n,) in server.query(
                "SELECT name FROM system.tables WHERE database = %(db)s", {"db": CLUSTER_DB}
            )
        }
        assert {
            "fidelity_scores",
            "fidelity_scores_local",
            "fidelity_shadows",
            "fidelity_shadows_local",
        } <= tables
    rows = [
        {
            "experiment": "e",
            "variant": "awq",
            "control": "fp16",
            "request_id": f"r{i}",
            "user_id": f"u{i % 7}",
            "config_revision": 3,
            "sent_at": 1_780_000_000 + i,
            "compared": "live",
            "outcome": "ok",
            "error": "",
            "identical": int(i % 4 != 0),
            "first_divergence": -1 if i % 4 else 2,
            "unit": "token",
            "variant_tokens": 8,
            "control_tokens": 8,
            "variant_fp": i,
            "control_fp": i,
        }
        for i in range(40)
    ]
    assert cstore.insert_fidelity_shadows(rows) == 40
    assert cstore.query("SELECT count(), sum(identical) FROM fidelity_shadows") == [(40, 30)]
    per_server = [
        s.query("SELECT count() FROM fidelity_shadows_local WHERE experiment = 'e'")[0][0] for s in servers
    ]
    assert sum(per_server) == 40 and all(n > 0 for n in per_server)  # sharded by the request's key


# ---- reads grouped by user, shard by shard -------------------------------------------------------

SLO = q.Slo(200.0)
PLAN = Plan(
    candidate="awq",
    control="fp16",
    steps=(5, 50, 100),
    min_samples=100,
    min_duration_s=0.0,
    guardrails=(),
    on_breach="rollback",
    notify=(),
    alpha=0.05,
)


def users_samples(experiment: str = "ttft-opt", duplicate_rate: float = 0.0) -> synthetic.Synthetic:
    """Heavy-tailed users, some sending many requests, 10% of the requests without a user (each
    a unit of its own), two config revisions; with ``duplicate_rate``, older recordings too."""
    return synthetic.generate(
        synthetic.SyntheticSpec(
            experiment=experiment,
            n=3000,
            seed=21,
            run_id=31,
            variants=synthetic.demo_variants(),
            factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
            config_revisions=(1, 2),
            users=150,
            no_user_share=0.1,
            duplicate_rate=duplicate_rate,
            duration_s=600.0,
        )
    )


def assert_same_moments(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) == 3
    for v in a:
        assert a[v].counts == b[v].counts, v
        np.testing.assert_allclose(a[v].sums, b[v].sums, rtol=1e-9, atol=0)


def assert_same_reading(a, b) -> None:
    assert a.error == b.error == ""
    for arm in ("control", "candidate"):
        x, y = getattr(a, arm), getattr(b, arm)
        assert (x.n, x.hits, x.errors) == (y.n, y.hits, y.errors) and x.n > 0, arm
        for metric in ("attainment", "error_rate"):
            gx, gy = getattr(x.per_user, metric), getattr(y.per_user, metric)
            assert (gx.clusters, gx.largest) == (gy.clusters, gy.largest), (arm, metric)
            np.testing.assert_allclose(gx.total, gy.total, rtol=1e-9, atol=0)
            np.testing.assert_allclose(gx.cross, gy.cross, rtol=1e-9, atol=0)


def spy_queries(stores, monkeypatch) -> list[tuple[str, str]]:
    """(store, SQL) of every query the given stores run from now on."""
    seen: list[tuple[str, str]] = []
    for store in stores:
        real = store.query

        def query(sql, params=None, *, settings=None, real=real, name=store.url_safe):
            seen.append((name, sql))
            return real(sql, params, settings=settings)

        monkeypatch.setattr(store, "query", query)
    return seen


def test_a_users_requests_land_on_one_shard_and_a_rerecording_still_collapses(cstore, servers):
    cstore.migrate()
    data = users_samples(duplicate_rate=0.05)
    synthetic.insert(cstore, data)
    per_shard = [
        {u for (u,) in s.query("SELECT DISTINCT user_id FROM samples_local WHERE user_id != ''")}
        for s in servers
    ]
    assert min(map(len, per_shard)) > 10 and not per_shard[0] & per_shard[1]
    # every recording of a request is on one shard: there the engine collapses them
    ids = [set(r for (r,) in s.query("SELECT DISTINCT request_id FROM samples_local")) for s in servers]
    assert not ids[0] & ids[1]
    unique = len(data.latest()["seq"])
    assert sum(local_rows(servers)) == data.n_rows > unique
    assert cstore.query(f"SELECT count() FROM {schema.SAMPLES_FROM}") == [(unique,)]
    assert cstore.deduplicate(31) == data.n_rows - unique
    assert sum(local_rows(servers)) == unique


def test_moments_per_shard_equal_one_query_over_the_same_rows(cstore, servers, single, monkeypatch):
    assert not cstore.samples_sharded_by_unit()  # no table yet: asked again once there is one
    data = users_samples()
    for store in (cstore, single):
        store.migrate()
        synthetic.insert(store, data)
    assert cstore.samples_sharded_by_unit()
    parts = cstore.unit_shards()
    assert [(table, part.url_safe) for _n, part, table in parts] == [
        ("samples_local", s.url_safe) for s in servers
    ]
    f = q.Filters("ttft-opt")
    shard_servers = [part for _n, part, _t in parts]
    for unit in units.UNITS:
        sql, params = units.moments_select(f, SLO, unit)
        distributed = units.rows_to_moments(cstore.query(sql, params))
        seen = spy_queries(shard_servers, monkeypatch)
        per_shard = RawReader(cstore).unit_moments(f, SLO, unit)
        assert sorted(name for name, sql in seen if "FROM samples_local " in sql) == sorted(
            s.url_safe for s in servers
        )
        monkeypatch.undo()
        assert_same_moments(per_shard, distributed)
        assert_same_moments(per_shard, RawReader(single).unit_moments(f, SLO, unit))
    # a rollout step's reading: the per-user moments under one revision, per shard
    seen = spy_queries(shard_servers, monkeypatch)
    reading = read_step(cstore, "ttft-opt", 1, PLAN, SLO)
    assert len([sql for _n, sql in seen if "FROM samples_local " in sql and "config_revision" in sql]) == 2
    monkeypatch.undo()
    assert_same_reading(reading, read_step(single, "ttft-opt", 1, PLAN, SLO))
    users = reading.control.per_user.attainment
    assert users.clusters < reading.control.n  # users who sent several requests: clustered
    # through the step's kept per-user sums (the controller's default), on the Distributed
    # tables: the first look keeps every sample, the next reads from them and counts every row
    # (the Distributed table has no parts of its own to settle)
    for _look in range(2):
        assert_same_reading(read_step(cstore, "ttft-opt", 1, PLAN, SLO, keep=True), reading)
    kept_rows = [
        s.query("SELECT count() FROM rollout_user_sums_local WHERE experiment = 'ttft-opt'")[0][0]
        for s in servers
    ]
    assert (
        all(kept_rows) and sum(kept_rows) == users.clusters + reading.candidate.per_user.attainment.clusters
    )
    # a fold's mark of its start and its state; the step's index on the entry (servers[0]) alone
    folds = cstore.query("SELECT state = '' FROM rollout_folds WHERE experiment = 'ttft-opt' ORDER BY 1")
    assert folds == [(0,), (1,)]
    indexes = [
        s.query(
            "SELECT count() FROM system.tables WHERE database = currentDatabase() "
            "AND name LIKE 'rollout_sums_index_%'"
        )[0][0]
        for s in servers
    ]
    assert indexes == [1, 0]


def test_a_cluster_sharded_the_older_way_is_read_through_its_distributed_table(
    cstore, servers, single, cluster_urls
):
    # the Distributed samples table as older code made it (sharded by the sorting key): what an
    # existing cluster keeps, CREATE TABLE IF NOT EXISTS leaving it as it is
    cstore.migrate()
    older = "sipHash64(experiment, variant, run_id, seq, request_id)"
    for server in servers:
        server.execute("DROP TABLE samples")
        server.execute(
            "CREATE TABLE samples AS samples_local "
            f"ENGINE = Distributed({CLUSTER}, {CLUSTER_DB}, samples_local, {older})"
        )
    store = ClickHouseClusterBackend(server_url_for(CLUSTER_DB, cluster_urls[0]), CLUSTER)
    try:
        assert store.migrate() == []
        data = users_samples()
        synthetic.insert(store, data)
        single.migrate()
        synthetic.insert(single, data)
        per_shard = [
            {u for (u,) in s.query("SELECT DISTINCT user_id FROM samples_local WHERE user_id != ''")}
            for s in servers
        ]
        assert per_shard[0] & per_shard[1]  # users on both shards: a shard's sums are not theirs
        assert not store.samples_sharded_by_unit()
        assert store.unit_shards() == [(store.describe(), store, "samples")]
        f = q.Filters("ttft-opt")
        for unit in units.UNITS:
            assert_same_moments(
                RawReader(store).unit_moments(f, SLO, unit), RawReader(single).unit_moments(f, SLO, unit)
            )
        assert_same_reading(
            read_step(store, "ttft-opt", 1, PLAN, SLO), read_step(single, "ttft-opt", 1, PLAN, SLO)
        )
    finally:
        store.close()


def test_a_shard_that_fails_fails_the_read_naming_it(cstore, servers, monkeypatch):
    cstore.migrate()
    synthetic.insert(cstore, users_samples())
    f = q.Filters("ttft-opt")
    name = rf"(?s)^shard 2 of cluster {CLUSTER} \(clickhouse://[^)]*:{servers[1]._conn_kwargs['port']}/"
    servers[1].execute("RENAME TABLE samples_local TO samples_away")
    try:
        with pytest.raises(StoreError, match=name + ".*(doesn't exist|There is no table)"):
            RawReader(cstore).unit_moments(f, SLO, "user")
    finally:
        servers[1].execute("RENAME TABLE samples_away TO samples_local")
    # a shard that is down: the error stays transient, and a rollout step reads as not read
    (_n1, first), (_n2, second) = cstore.shards()

    def down(*a, **kw):
        raise StoreUnavailable("connection refused (test)")

    monkeypatch.setattr(second, "query", down)
    with pytest.raises(StoreUnavailable, match=name + ".*connection refused"):
        RawReader(cstore).unit_moments(f, SLO, "user")
    reading = read_step(cstore, "ttft-opt", 1, PLAN, SLO)
    assert f"shard 2 of cluster {CLUSTER}" in reading.error and reading.control is None
