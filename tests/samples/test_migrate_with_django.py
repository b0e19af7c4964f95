"""`manage.py migrate` migrates the sample store too, and what needs its tables says what to run.

Before, `migrate` left the sample store alone and the first replay failed with a raw ClickHouse
error ("Unknown table expression identifier 'samples'"). Now `migrate` applies the store's
migrations after the Django database, and a store that still lacks them (migrated with
--skip-sample-store, or by older code) makes the replay, the report and flush_samples stop with
one message naming the command, on chDB and on the ClickHouse server.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from samples import factory, schema
from samples.spool import Spool
from samples.store import NotMigrated, StoreError

KINDS = ("chdb", "server")
ALL = [m.version for m in schema.MIGRATIONS]


@pytest.fixture(params=KINDS)
def configured(request, make_store, settings, chdb_dir, tmp_path):
    """Django's sample store on a fresh, unmigrated database of each kind; the same database
    through a store object of its own (to look at it from outside the process's store)."""
    store = make_store(request.param)
    if request.param == "chdb":
        settings.CLICKHOUSE_URL, settings.CHDB_PATH, settings.CHDB_DATABASE = "", chdb_dir, store.database
    else:
        store.ensure_database()
        settings.CLICKHOUSE_URL = store.url_safe.replace("clickhouse://", "clickhouse://default:@")
    settings.SPOOL_DIR = tmp_path / "spool"
    factory._cache.clear()
    yield store
    factory._cache.clear()


def applied(store) -> list[int]:
    return [m["version"] for m in store.migration_status() if m["applied"]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_migrate_applies_the_sample_store_migrations_once(configured):
    out = io.StringIO()
    call_command("migrate", stdout=out)
    assert "Sample store migrations:" in out.getvalue()
    for v in ALL:
        assert f"applied {v:04d} on {configured.describe()}" in out.getvalue()
    assert applied(configured) == ALL
    again = io.StringIO()
    call_command("migrate", stdout=again)
    assert f"no migrations to apply on {configured.describe()}" in again.getvalue()
    quiet = io.StringIO()
    call_command("migrate", verbosity=0, stdout=quiet)
    assert quiet.getvalue() == ""
    assert configured.query(f"SELECT count() FROM {schema.MIGRATIONS_TABLE}") == [(len(ALL),)]  # once each


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_skip_sample_store_and_check(configured):
    call_command("migrate", "--skip-sample-store", verbosity=0)
    assert applied(configured) == []
    with pytest.raises(SystemExit) as exit_:
        call_command("migrate", "--check", stdout=io.StringIO())
    assert exit_.value.code == 1  # the Django database is current; the sample store is not
    call_command("migrate", verbosity=0)
    call_command("migrate", "--check", stdout=io.StringIO())  # returns: nothing left anywhere


def test_a_query_on_a_store_not_migrated_names_the_command(configured):
    store = factory.sample_store()
    with pytest.raises(factory.SampleStoreNotMigrated) as err:
        store.count(1)
    msg = str(err.value)
    assert msg.startswith(
        f"the sample store ({store.describe()}) is not migrated: it lacks 0001 'create samples'"
    )
    assert "Run `python manage.py migrate`" in msg and "clickhouse_migrate" in msg
    # both a StoreError (callers that handle the store's errors) and a CommandError (commands)
    assert isinstance(err.value, StoreError) and isinstance(err.value, CommandError)
    assert err.value.__cause__ is not None  # the raw error, kept as the cause
    with pytest.raises(NotMigrated, match="not migrated"):
        store.check_schema()
    store.migrate()
    store.check_schema()
    assert store.count(1) == 0


def test_the_schema_check_is_asked_once_per_store(configured):
    configured.migrate()
    configured.check_schema()
    configured.execute(f"DROP TABLE {schema.MIGRATIONS_TABLE}")
    configured.check_schema()  # answered from this process's memory: no second query
    fresh = factory.store_from_config(
        factory.sample_store().url_safe.replace("clickhouse://", "clickhouse://default:@")
        if configured.backend_name == "clickhouse-server"
        else "",
        configured.path if configured.backend_name == "chdb" else "",
        database=configured.database,
    )
    with pytest.raises(NotMigrated, match="it lacks 0001"):
        fresh.check_schema()


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_flush_samples_on_a_store_not_migrated_keeps_the_spool_and_names_the_command(
    configured, make_rows, settings
):
    spool = Spool(str(settings.SPOOL_DIR))
    spool.append(make_rows(3))
    with pytest.raises(CommandError, match=r"is not migrated: .* Run `python manage.py migrate`"):
        call_command("flush_samples", stdout=io.StringIO())
    assert len(spool.pending_files()) == 1  # nothing lost: flushed once the store is migrated
    call_command("migrate", verbosity=0)
    out = io.StringIO()
    call_command("flush_samples", stdout=out)
    assert "flushed 3 samples" in out.getvalue()
    assert configured.count(7) == 3


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_replay_and_report_on_a_store_not_migrated_name_the_command(configured, running):
    from workers.models import ReplayRun

    with pytest.raises(
        CommandError,
        match=r"nothing was sent: the sample store .* is not migrated: .* Run `python manage.py migrate`",
    ):
        call_command(
            "replay",
            "ttft-opt",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "5",
            stdout=io.StringIO(),
        )
    assert not ReplayRun.objects.exists()
    with pytest.raises(
        CommandError, match=r"is not migrated: it lacks 0001 .* Run `python manage.py migrate`"
    ):
        call_command("sla_report", "ttft-opt", stdout=io.StringIO())


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_the_replay_api_refuses_with_the_command_to_run(configured, running, client_for, settings, tmp_path):
    from traces.storage import store_file
    from workers.models import ReplayRun

    settings.TRACE_DIR = tmp_path / "traces"
    store_file("data/traces/azure_llm_2023_code.csv")
    response = client_for("sre").post(
        "/api/replays/",
        {"experiment": "ttft-opt", "trace": "azure_llm_2023_code.csv", "limit": 5},
        format="json",
    )
    assert response.status_code == 400, response.content
    assert "Run `python manage.py migrate`" in str(response.json())
    assert not ReplayRun.objects.exists()


@pytest.mark.process
def test_migrate_while_another_process_owns_the_chdb_store_says_what_to_do(chdb_dir, tmp_path):
    """The embedded store opened by a running process (runserver, a shell): the database is
    migrated, and the command fails naming the lock's holder and the command to run after."""
    import os
    import subprocess
    import sys

    from samples.backends.chdb import ChdbBackend
    from tests.workers.background import ROOT

    ChdbBackend(chdb_dir, "abplat_test_lock").ping()  # this process owns the directory
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    env.update(ABPLAT_VAR=str(tmp_path), ABPLAT_CHDB_PATH=chdb_dir, ABPLAT_DEBUG="true")
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the database is migrated, the sample store is not" in done.stderr
    assert f"is locked by another process (pid {os.getpid()})" in done.stderr
    assert "run `.venv/bin/python manage.py clickhouse_migrate`" in done.stderr
    # One line, as every abplat command's refusal (experiments.cli)
    assert done.stderr.startswith("abplat: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (tmp_path / "abplat.sqlite3").exists()
