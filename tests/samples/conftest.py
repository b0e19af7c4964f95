"""Sample store fixtures: every store test runs on chDB and on the real ClickHouse server.

The server must be running (scripts/clickhouse.sh start). ``store`` is the session's migrated
database of each kind, emptied before each test (tests/sample_dbs.py, the root conftest's
shared_database); ``fresh_store`` and ``make_store`` give a test a database of its own, dropped
afterwards: for tests of migrations themselves, and for tests that drop the database, change its
schema or its migrations table, or reach it through a proxy they switch off. chDB opens one data
directory per process, so the whole session shares one directory (the root conftest's
``chdb_dir``) and isolates databases by name.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from samples.backends.chdb import ChdbBackend
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.store import SampleStore, StoreUnavailable
from tests.plugin import SERVER_URL, FlakyProxy, server_url_for


def _fresh_db() -> str:
    return f"abplat_test_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_store(request: pytest.FixtureRequest, chdb_dir: str) -> Iterator:
    """make_store(kind, url=None, **kw) -> a store on a fresh database of that kind, not migrated
    (the test migrates it, or not), dropped after the test."""
    made: list[SampleStore] = []

    def make(kind: str, url: str | None = None, **kw) -> SampleStore:
        db = _fresh_db()
        if kind == "chdb":
            store: SampleStore = ChdbBackend(chdb_dir, db)
        else:
            request.getfixturevalue("clickhouse_server")
            store = ClickHouseServerBackend(server_url_for(db, url or SERVER_URL), **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        try:
            cleanup = (
                ClickHouseServerBackend(server_url_for(store.database))
                if isinstance(store, ClickHouseServerBackend)
                else store
            )
            cleanup.execute(f"DROP DATABASE IF EXISTS {store.database}")
            cleanup.close()
        except Exception:  # a test that broke the server must not hide its own failure
            pass
        store.close()


@pytest.fixture(params=["chdb", "server"])
def store(request: pytest.FixtureRequest, shared_store) -> SampleStore:
    """A store of each kind on the session's migrated database, empty when the test starts."""
    return shared_store(request.param)


@pytest.fixture(params=["chdb", "server"])
def fresh_store(request: pytest.FixtureRequest, make_store) -> SampleStore:
    """A store of each kind on a database of its own, migrated, dropped after the test: for a
    test that changes the schema or the migrations table (the session's database is only ever
    emptied)."""
    s = make_store(request.param)
    s.migrate()
    return s


@pytest.fixture
def flaky_server(clickhouse_server: str) -> Iterator[tuple[FlakyProxy, str]]:
    """(proxy, url) where url reaches the real server through the switchable proxy."""
    parts = urllib.parse.urlsplit(clickhouse_server)
    proxy = FlakyProxy((parts.hostname or "127.0.0.1", parts.port or 9000))
    proxy.up()
    auth = f"{parts.username or 'default'}:{parts.password or ''}"
    url = urllib.parse.urlunsplit(parts._replace(netloc=f"{auth}@127.0.0.1:{proxy.port}"))
    yield proxy, url
    proxy.down()


# The inter-token gaps of the row below (27 token chunks: 26 gaps, microseconds), with the
# extremes of Array(UInt32): 0 and 2**32 - 1.
GAPS_US = [3900, 4100, 0, 15500, 2**32 - 1, *range(3000, 3021)]
# Its answer's token fingerprints: Array(UInt32)'s extremes and the empty text's (fidelity.fingerprints).
TOKEN_FPS = [0x9E3779B9, 0, 2**32 - 1, 17]
# Its answer's text (kept where the experiment allows it): unicode, quotes, escapes, a NUL.
ANSWER_TEXT = "Grüße, 日本語 «answer» 'quoted' \\ back\nslash\x00 and 🙂"


def sample_row(seq_: int, **over: Any) -> dict[str, Any]:
    """One valid samples row of run 7, variant awq, every column set (most to non-default
    values, unicode and escapes in `error`); `over` replaces columns. The request id follows
    samples.rows.request_id for split mode unless given."""
    row: dict[str, Any] = dict(
        experiment="ttft-opt",
        variant="awq",
        run_id=7,
        seq=seq_,
        request_id="",
        mode="split",
        user_id=f"user-{seq_ % 5}",
        config_revision=42,
        sent_at=0,
        sent_unix_ms=1_732_900_000_123.456 + seq_ * 10,
        scheduled_offset_ms=seq_ * 10.0,
        schedule_lag_ms=0.75,
        gateway_ms=0.0,  # a replay's row (samples.rows)
        in_flight=3,
        prompt_tokens=512,
        prompt_tokens_estimated=0,
        max_tokens=64,
        worker="host-a:1234",
        attempt=1,
        outcome="stall",
        http_status=200,
        error="stall after 12 tokens: «Überlauf» 日本語 'quoted' \\ back\nslash",
        new_connection=1,
        connect_ms=1.25,
        ttfb_ms=3.5,
        first_byte_ms=3.75,
        ttft_event_ms=20.125,
        ttft_ms=21.5,
        itl_mean_ms=4.0,
        itl_p50_ms=3.9,
        itl_p99_ms=12.0,
        itl_max_ms=15.5,
        itl_gaps_us=list(GAPS_US),
        tpot_ms=4.1,
        e2e_ms=120.0,
        output_tokens=25,
        usage_reported=1,
        chunks=27,
        finish_reason="length",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        trace_id="0af7651916cd43dd8448eb211c80319c",
        server_ttft_ms=19.0,
        start_ns=2**62 + 17,
        server_first_content_ns=2**62 + 19_000_017,
        output_fp=2**64 - 3,  # the extremes of UInt64 and Array(UInt32) again
        token_fps=list(TOKEN_FPS),
        answer_text=ANSWER_TEXT,
        recorded_ms=1_732_900_001_000 + seq_,
    )
    row.update(over)
    row["request_id"] = row["request_id"] or f"r{row['run_id']}-{row['seq']}"
    row["sent_at"] = int(row["sent_unix_ms"] // 1000)
    return row


@pytest.fixture
def make_rows():
    """make_rows(n, start=0, **column overrides) -> n sample rows of run 7, variant awq."""

    def make(n: int, start: int = 0, **over: Any) -> list[dict[str, Any]]:
        return [sample_row(i, **over) for i in range(start, start + n)]

    return make


def switch_off(store: SampleStore, monkeypatch, error: type[Exception] = StoreUnavailable) -> threading.Event:
    """While the returned event is set, the store's writes and key lookups raise ``error``:
    StoreUnavailable as a store that went away does, or another StoreError as a store that
    refuses rows."""
    real = {name: getattr(store, name) for name in ("insert_columns", "insert_samples", "existing_keys")}
    down = threading.Event()

    def failing(name):
        def call(*a, **k):
            if down.is_set():
                raise error("the store is down (test)")
            return real[name](*a, **k)

        return call

    for name in real:
        monkeypatch.setattr(store, name, failing(name))
    return down


def hang_inserts(store: SampleStore, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(entered, gate): the store's inserts set ``entered`` and wait for ``gate`` before they
    insert, as a store that does not answer (until the test sets the gate)."""
    real_insert = store.insert_columns
    entered, gate = threading.Event(), threading.Event()

    def hanging(cols):
        entered.set()
        gate.wait()
        return real_insert(cols)

    monkeypatch.setattr(store, "insert_columns", hanging)
    return entered, gate


def physical(store: SampleStore, run_id: int) -> tuple[int, int]:
    """(rows on disk, distinct keys) of a run, without FINAL: a duplicate shows as a difference."""
    [(n, keys)] = store.query(
        "SELECT count(), uniqExact(experiment, variant, run_id, request_id) FROM samples WHERE run_id = %(r)s",
        {"r": run_id},
    )
    return int(n), int(keys)


def wait_until(predicate, what: str, limit_s: float = 30.0) -> None:
    """Poll until predicate() (a hang fails with `what`, not a timing claim)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)
