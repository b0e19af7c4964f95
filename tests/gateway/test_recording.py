"""The gateway's sample recorder (gateway/recording.py): live samples land in the store with the
replay's row, mode live; the store down during traffic costs nothing and loses nothing; close()
drains. Every test runs on chDB and on the real ClickHouse server."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gateway.models import LIVE_RUN_ID_BASE, LiveRun, live_runs
from gateway.recording import LiveRecorder
from samples.columns import row_key
from samples.schema import SAMPLES_FROM
from samples.store import StoreUnavailable
from streaming.result import Outcome, StreamResult
from tests.samples.conftest import make_store  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)  # the recorder's thread has its own connection


@pytest.fixture(params=["chdb", "server"])
def store(request, make_store):  # noqa: F811
    s = make_store(request.param)
    s.migrate()
    return s


def result(i: int, **over: Any) -> StreamResult:
    fields: dict[str, Any] = dict(
        outcome=Outcome.OK, http_status=200, new_connection=i == 0, connect_ms=0.5 if i == 0 else None,
        ttfb_ms=2.0 + i, first_byte_ms=2.1 + i, ttft_event_ms=9.0 + i, ttft_ms=10.0 + i,
        itl_mean_ms=4.0, itl_p50_ms=4.0, itl_p99_ms=5.0, itl_max_ms=5.0, itl_gaps_us=[4000, 5000],
        tpot_ms=4.5, e2e_ms=30.0 + i, output_tokens=3, prompt_tokens=17, usage_reported=True, chunks=3,
        finish_reason="stop", start_ns=10**12 + i,
    )  # fmt: skip
    fields.update(over)
    return StreamResult(**fields)


def record(
    rec: LiveRecorder, i: int, *, experiment: str = "ttft-opt", variant: str | None = None, **over
) -> str:
    rid = f"req-{i:06d}"
    ctx: dict[str, Any] = dict(
        experiment=experiment, variant=variant or ("fp16", "awq")[i % 2], user_id=f"user-{i % 7}",
        config_revision=41 + i % 2, sent_unix_ms=1_764_640_000_000.0 + i, request_id=rid,
        prompt_tokens=20, max_tokens=64, gateway_ms=0.25,
    )  # fmt: skip
    ctx.update(over)
    rec.record(result(i), **ctx)
    return rid


def stored(store, run_id: int) -> list[dict[str, Any]]:
    cols = ["experiment", "variant", "run_id", "seq", "request_id", "mode", "user_id", "config_revision",
            "sent_unix_ms", "schedule_lag_ms", "worker", "attempt", "ttft_ms", "prompt_tokens",
            "itl_gaps_us"]  # fmt: skip
    rows = store.query(
        f"SELECT {', '.join(cols)} FROM samples WHERE run_id = %(r)s ORDER BY seq", {"r": run_id}
    )
    return [dict(zip(cols, r, strict=True)) for r in rows]


def physical(store, run_id: int) -> tuple[int, int]:
    """(rows on disk, distinct keys) of a run, without FINAL: a duplicate shows as a difference."""
    [(n, keys)] = store.query(
        "SELECT count(), uniqExact(experiment, variant, run_id, request_id) FROM samples WHERE run_id = %(r)s",
        {"r": run_id},
    )
    return int(n), int(keys)


def recorder(store, tmp_path, **kw) -> LiveRecorder:
    kw.setdefault("batch_rows", 10)
    kw.setdefault("flush_ms", 20.0)
    kw.setdefault("retry_s", 0.05)
    kw.setdefault("heartbeat_s", 0.05)
    return LiveRecorder(worker="gw-test:1", store=store, spool_dir=str(tmp_path / "spool"), **kw)


def test_live_samples_land_with_mode_live_and_the_request_s_context(store, tmp_path):
    rec = recorder(store, tmp_path)
    rec.start()
    run_id = rec.run_id
    assert run_id is not None and run_id > LIVE_RUN_ID_BASE
    ids = [record(rec, i) for i in range(25)]
    assert rec.close() is True

    rows = stored(store, run_id)
    assert [r["request_id"] for r in rows] == ids  # seq follows the order of record()
    assert [r["seq"] for r in rows] == list(range(1, 26))
    first = rows[0]
    assert first["mode"] == "live" and first["experiment"] == "ttft-opt" and first["variant"] == "fp16"
    assert first["user_id"] == "user-0" and first["config_revision"] == 41 and first["worker"] == "gw-test:1"
    assert first["sent_unix_ms"] == 1_764_640_000_000.0 and first["schedule_lag_ms"] == 0.25
    assert first["attempt"] == 1 and first["ttft_ms"] == 10.0 and list(first["itl_gaps_us"]) == [4000, 5000]
    assert first["prompt_tokens"] == 17  # the usage event's count wins over the gateway's 20

    run = LiveRun.for_run_id(run_id)
    assert run.status == LiveRun.Status.CLOSED and run.closed_at is not None
    assert (run.recorded, run.stored, run.spooled, run.dropped, run.rejected) == (25, 25, 0, 0, 0)
    assert run.experiments == {"ttft-opt": 25}
    assert list(live_runs("ttft-opt")) == [run] and list(live_runs("other")) == []
    assert run.summary()["mode"] == "live" and run.summary()["run_id"] == run_id


def test_each_process_start_is_a_new_run(store, tmp_path):
    first = recorder(store, tmp_path)
    first.start()
    record(first, 0)
    first.close()
    second = recorder(store, tmp_path)
    second.start()
    record(second, 0)  # the same request id again, in the next run: its own sample
    second.close()
    assert second.run_id != first.run_id
    assert [r["seq"] for r in stored(store, first.run_id)] == [1]
    assert [r["seq"] for r in stored(store, second.run_id)] == [1]


def test_the_store_down_during_traffic_spools_and_flushes_later_exactly_once(
    make_store, tmp_path, monkeypatch
):  # noqa: F811
    store = make_store("server", tries=1, backoff_s=(0.01,), connect_timeout=0.5)
    store.migrate()
    real = {name: getattr(store, name) for name in ("insert_columns", "insert_samples", "existing_keys")}
    down = threading.Event()

    def failing(name):
        def call(*a, **k):
            if down.is_set():
                raise StoreUnavailable("the store is down (test)")
            return real[name](*a, **k)

        return call

    for name in real:
        monkeypatch.setattr(store, name, failing(name))
    rec = recorder(store, tmp_path)
    rec.start()
    ids = [record(rec, i) for i in range(30)]
    down.set()
    ids += [record(rec, i) for i in range(30, 200)]
    assert rec.close() is True  # drained to the spool: the store is still down
    run = LiveRun.for_run_id(rec.run_id)
    assert run.recorded == 200 and run.stored + run.spooled == 200 and run.spooled > 0 and run.dropped == 0
    assert run.spool_rows == run.spooled  # the spool's books: what waits there of the run

    down.clear()
    report = rec.writer.flush()  # what `manage.py flush_samples` or the next start does
    assert report.inserted + report.skipped_stored == run.spooled
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert physical(store, rec.run_id) == (200, 200)
    LiveRun.sync_spool(rec.writer.spool.id, rec.writer.spool.rows_by_run())
    assert LiveRun.for_run_id(rec.run_id).spool_rows == 0


def test_row_key_is_the_experiment_variant_run_and_request_id():
    assert row_key({"experiment": "e", "variant": "v", "run_id": LIVE_RUN_ID_BASE + 1, "request_id": "x"}) == (
        "e", "v", LIVE_RUN_ID_BASE + 1, "x",
    )  # fmt: skip
    assert SAMPLES_FROM.endswith("FINAL")
