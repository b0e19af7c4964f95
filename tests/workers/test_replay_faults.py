"""Faults during a replay end with exactly the right samples: the sample store going down
mid-run (samples spool, then flush in order without duplicates)."""

import io
import urllib.parse
import uuid
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from samples import factory
from tests.plugin import FlakyProxy, server_url_for
from tests.workers.background import replay_in_thread, wait_for
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.fixture
def flaky_store(settings, clickhouse_server, tmp_path):
    """The Django sample store on the real server, reached through a switchable proxy."""
    parts = urllib.parse.urlsplit(clickhouse_server)
    proxy = FlakyProxy((parts.hostname, parts.port or 9000))
    proxy.up()
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    direct = server_url_for(database, clickhouse_server)
    settings.CLICKHOUSE_URL = urllib.parse.urlunsplit(
        urllib.parse.urlsplit(direct)._replace(netloc=f"default:@127.0.0.1:{proxy.port}")
    )
    settings.SPOOL_DIR = tmp_path / "spool"
    factory._cache.clear()
    store = factory.sample_store()
    store.ensure_database()
    store.migrate()
    yield proxy, store
    proxy.down()
    from samples.backends.clickhouse import ClickHouseServerBackend

    ClickHouseServerBackend(direct).execute(f"DROP DATABASE IF EXISTS {database}")
    factory._cache.clear()


def recorded_samples(store, run_id):
    rows = store.query("SELECT seq, count() FROM samples WHERE run_id = %(r)s GROUP BY seq", {"r": run_id})
    return dict(rows)


@pytest.mark.django_db(transaction=True)
def test_store_down_mid_run_spools_then_flushes_exactly_once(running, flaky_store, settings):
    proxy, store = flaky_store
    thread, out, errors = replay_in_thread("--limit", "300", "--speed", "80")  # ~6 s of schedule
    wait_for(lambda: ReplayRun.objects.filter(shards__recorded__gt=30).exists())
    proxy.down()
    spool = Path(settings.SPOOL_DIR)
    wait_for(lambda: any(spool.glob("*.jsonl")))  # samples recorded now went to the spool
    proxy.up()
    thread.join(120)
    assert not errors, out.getvalue()
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.samples_recorded == 300
    per_seq = recorded_samples(store, run.pk)  # raw rows, before any merge: no duplicate at all
    assert sorted(per_seq) == list(range(300)) and set(per_seq.values()) == {1}


@pytest.mark.django_db(transaction=True)
def test_run_waits_for_a_down_store_and_flush_samples_ends_it(running, flaky_store, monkeypatch):
    proxy, store = flaky_store
    # The store goes down right after the replay checked it, before any sample is written: a
    # replay this short may end before a poll would see it running.
    checked = store.check_schema
    monkeypatch.setattr(store, "check_schema", lambda: (checked(), proxy.down())[0])
    thread, out, errors = replay_in_thread("--limit", "60", "--speed", "200")
    thread.join(120)
    assert errors and "flush_samples" in str(errors[0])
    run = ReplayRun.objects.get()
    assert run.status == "flushing"
    with pytest.raises(CommandError, match="still unavailable"):
        call_command("flush_samples", stdout=io.StringIO())
    proxy.up()
    text = io.StringIO()
    call_command("flush_samples", stdout=text)
    run.refresh_from_db()
    assert run.status == "done" and run.samples_recorded == 60, text.getvalue()
    assert set(recorded_samples(store, run.pk).values()) == {1}
