"""The gateway's sample recorder (gateway/recording.py): live samples land in the store with the
replay's row, mode live; the store down during traffic costs nothing and loses nothing; close()
drains. Every test runs on chDB and on the real ClickHouse server."""

from __future__ import annotations

import functools
import signal
import time
from typing import Any

import httpx
import openai
import pytest

from experiments import services
from gateway.models import LIVE_RUN_ID_BASE, LiveRun, live_runs
from gateway.recording import LiveRecorder
from samples.columns import row_key
from samples.schema import SAMPLES_FROM
from simulator.serve import start_in_thread
from streaming.result import Outcome, StreamResult
from tests.gateway.conftest import KEY, FakeRecorder
from tests.gateway.test_command import start_gateway_command
from tests.samples import conftest as samples_conftest
from tests.samples.conftest import flaky_server, hang_inserts, make_store, physical, switch_off  # noqa: F401 - fixtures

# the recorder's thread has its own connection
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def result(i: int, **over: Any) -> StreamResult:
    fields: dict[str, Any] = dict(
        outcome=Outcome.OK,
        http_status=200,
        new_connection=i == 0,
        connect_ms=0.5 if i == 0 else None,
        ttfb_ms=2.0 + i,
        first_byte_ms=2.1 + i,
        ttft_event_ms=9.0 + i,
        ttft_ms=10.0 + i,
        itl_mean_ms=4.0,
        itl_p50_ms=4.0,
        itl_p99_ms=5.0,
        itl_max_ms=5.0,
        itl_gaps_us=[4000, 5000],
        tpot_ms=4.5,
        e2e_ms=30.0 + i,
        output_tokens=3,
        prompt_tokens=17,
        usage_reported=True,
        chunks=3,
        finish_reason="stop",
        start_ns=10**12 + i,
    )
    fields.update(over)
    return StreamResult(**fields)


def record(
    rec: LiveRecorder, i: int, *, experiment: str = "ttft-opt", variant: str | None = None, **over
) -> str:
    rid = f"req-{i:06d}"
    ctx: dict[str, Any] = dict(
        experiment=experiment,
        variant=variant or ("fp16", "awq")[i % 2],
        user_id=f"user-{i % 7}",
        config_revision=41 + i % 2,
        sent_unix_ms=1_764_640_000_000.0 + i,
        request_id=rid,
        prompt_tokens=20,
        max_tokens=64,
        gateway_ms=0.25,
    )
    ctx.update(over)
    rec.record(result(i), **ctx)
    return rid


def stored(store, run_id: int) -> list[dict[str, Any]]:
    cols = [
        "experiment",
        "variant",
        "run_id",
        "seq",
        "request_id",
        "mode",
        "user_id",
        "config_revision",
        "sent_unix_ms",
        "schedule_lag_ms",
        "gateway_ms",
        "worker",
        "attempt",
        "ttft_ms",
        "prompt_tokens",
        "itl_gaps_us",
    ]
    rows = store.query(
        f"SELECT {', '.join(cols)} FROM samples WHERE run_id = %(r)s ORDER BY seq", {"r": run_id}
    )
    return [dict(zip(cols, r, strict=True)) for r in rows]


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
    assert first["sent_unix_ms"] == 1_764_640_000_000.0
    # the gateway's own time has its column; a live sample has no schedule, so no schedule lag
    assert first["gateway_ms"] == 0.25 and first["schedule_lag_ms"] == 0.0
    assert all(r["gateway_ms"] == 0.25 and r["schedule_lag_ms"] == 0.0 for r in rows)
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
    clickhouse_server, shared_store, tmp_path, monkeypatch
):
    store = shared_store("server", tries=1, backoff_s=(0.01,), connect_timeout=0.5)
    down = switch_off(store, monkeypatch)
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
    assert row_key(
        {"experiment": "e", "variant": "v", "run_id": LIVE_RUN_ID_BASE + 1, "request_id": "x"}
    ) == (
        "e",
        "v",
        LIVE_RUN_ID_BASE + 1,
        "x",
    )
    assert SAMPLES_FROM.endswith("FINAL")


# the recorder's waits include heartbeats and spool retries: a longer limit for a hang
wait_until = functools.partial(samples_conftest.wait_until, limit_s=60.0)


def test_the_recorder_s_own_retry_stores_what_it_spooled_once_the_store_is_back(store, tmp_path, monkeypatch):
    down = switch_off(store, monkeypatch)
    down.set()
    rec = recorder(store, tmp_path)
    rec.start()
    ids = [record(rec, i) for i in range(50)]
    wait_until(lambda: rec.counts()["spooled"] == 50, "all 50 spooled")
    down.clear()  # back: the recorder's retry flushes the spool, new samples go to the store
    ids += [record(rec, i) for i in range(50, 80)]
    wait_until(lambda: len(stored(store, rec.run_id)) == 80, "every sample stored")
    assert rec.close() is True
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert physical(store, rec.run_id) == (80, 80)
    assert rec.writer.pending() == 0
    run = LiveRun.for_run_id(rec.run_id)
    # the 30 after the store came back went to it, or to the spool until the retry saw it back
    assert (run.recorded, run.spooled + run.stored, run.dropped, run.spool_rows) == (80, 80, 0, 0)
    assert run.spooled >= 50


def test_a_hung_store_never_holds_record_and_nothing_is_dropped_while_it_hangs(store, tmp_path, monkeypatch):
    entered, gate = hang_inserts(store, monkeypatch)
    # batches leave only when full: the first holds exactly the first 10
    rec = recorder(store, tmp_path, batch_rows=10, flush_ms=60_000.0)
    rec.start()
    ids = [record(rec, i) for i in range(10)]
    entered.wait()  # the recorder holds those 10 in an insert that does not return
    ids += [record(rec, i) for i in range(10, 60)]  # each returns at once: in the queue file
    # (the memory queue of old refused all but 30 of these 50, counted as dropped)
    assert rec.queued() == 60 and rec.counts()["dropped"] == 0
    gate.set()
    assert rec.close() is True
    run = LiveRun.for_run_id(rec.run_id)
    assert (run.recorded, run.stored + run.spooled, run.dropped) == (60, 60, 0)
    rec.writer.flush()
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert physical(store, rec.run_id) == (60, 60)


def test_close_drains_every_queued_sample_and_later_ones_are_counted_not_kept(store, tmp_path):
    rec = recorder(store, tmp_path, batch_rows=1000, flush_ms=60_000.0)  # nothing leaves until close
    rec.start()
    ids = [record(rec, i) for i in range(123)]
    assert rec.close() is True
    record(rec, 999)  # after close: counted as dropped
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert rec.counts()["dropped"] == 1


def test_an_invalid_measurement_is_rejected_and_counted_and_the_rest_is_stored(store, tmp_path):
    rec = recorder(store, tmp_path)
    rec.start()
    ok = [record(rec, 0), record(rec, 1)]
    record(rec, 2, config_revision="three")  # a bug in the caller: never raised at it
    ok.append(record(rec, 3))
    assert rec.close() is True
    rows = stored(store, rec.run_id)
    assert [r["request_id"] for r in rows] == ok and [r["seq"] for r in rows] == [1, 2, 3]
    run = LiveRun.for_run_id(rec.run_id)
    assert (run.recorded, run.rejected, run.stored) == (3, 1, 3)


def test_a_run_that_used_every_seq_goes_on_as_a_new_run(store, tmp_path):
    rec = recorder(store, tmp_path, max_seq=7)
    rec.start()
    first = rec.run_id
    ids = [record(rec, i) for i in range(10)]
    assert rec.close() is True
    second = rec.run_id
    assert second != first
    assert [r["request_id"] for r in stored(store, first)] == ids[:7]
    assert [(r["seq"], r["request_id"]) for r in stored(store, second)] == [
        (1, ids[7]),
        (2, ids[8]),
        (3, ids[9]),
    ]
    runs = {r.run_id: r for r in LiveRun.objects.all()}
    assert runs[first].status == runs[second].status == LiveRun.Status.CLOSED
    assert (runs[first].recorded, runs[second].recorded) == (7, 3)


def test_the_run_catalog_says_running_while_open_and_done_once_closed(store, tmp_path):
    rec = recorder(store, tmp_path)
    rec.start()
    record(rec, 0)
    record(rec, 1, experiment="other-exp")
    wait_until(
        lambda: {r["experiment"] for r in stored(store, rec.run_id)} == {"ttft-opt", "other-exp"}, "stored"
    )
    wait_until(lambda: [r["status"] for r in store.runs("other-exp")] == ["running"], "catalogued running")
    assert rec.close() is True
    for experiment in ("ttft-opt", "other-exp"):
        [run] = store.runs(experiment)
        assert (run["run_id"], run["mode"], run["source"], run["status"]) == (
            rec.run_id,
            "live",
            "live",
            "done",
        )
    assert LiveRun.for_run_id(rec.run_id).catalog_final


def test_a_run_closed_while_the_store_was_down_is_catalogued_done_by_the_next_start(
    store, tmp_path, monkeypatch
):
    down = switch_off(store, monkeypatch)
    down.set()
    first = recorder(store, tmp_path)
    first.start()
    record(first, 0)
    assert first.close() is True
    # its sample waits in the spool: the catalog may say running, never done
    assert [r["status"] for r in store.runs("ttft-opt")] in ([], ["running"])
    assert not LiveRun.for_run_id(first.run_id).catalog_final
    down.clear()
    second = recorder(store, tmp_path)
    second.start()  # flushes the spool, then catalogues the closed run
    assert second.close() is True
    assert [(r["run_id"], r["status"]) for r in store.runs("ttft-opt")] == [(first.run_id, "done")]
    assert len(stored(store, first.run_id)) == 1


def test_a_real_server_unreachable_mid_traffic_then_back_gets_every_sample_once(
    make_store,  # noqa: F811 - the fixture imported above
    flaky_server,  # noqa: F811
    tmp_path,
):
    proxy, url = flaky_server
    store = make_store("server", url=url, tries=2, backoff_s=(0.05,), connect_timeout=1.0)
    store.migrate()
    rec = recorder(store, tmp_path)
    rec.start()
    ids = [record(rec, i) for i in range(40)]
    wait_until(lambda: rec.counts()["stored"] == 40, "the first 40 stored")
    proxy.down()
    ids += [record(rec, i) for i in range(40, 140)]  # each returns at once: queued
    wait_until(lambda: rec.counts()["spooled"] == 100, "the 100 spooled")
    proxy.up()
    ids += [record(rec, i) for i in range(140, 160)]
    wait_until(
        lambda: rec.writer.pending() == 0 and rec.counts()["stored"] + rec.counts()["spooled"] == 160,
        "the spool flushed by the recorder's retry",
    )
    assert rec.close() is True
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert physical(store, rec.run_id) == (160, 160)
    run = LiveRun.for_run_id(rec.run_id)
    assert (run.recorded, run.stored + run.spooled, run.dropped, run.spool_rows) == (160, 160, 0, 0)


def test_the_spool_books_of_live_and_replay_runs_never_take_each_other_s_rows(tmp_path):
    from workers.models import SpoolRecord

    run = LiveRun.register("host-a:/spool", "gw:1")
    other = LiveRun.register("host-b:/spool", "gw:2")
    LiveRun.objects.filter(pk=other.pk).update(spool_rows=4)
    # a spool holding rows of replay run 7 and of the live run: each book takes only its own
    LiveRun.sync_spool("host-a:/spool", {7: 3, run.run_id: 5})
    SpoolRecord.sync("host-a:/spool", {7: 3, run.run_id: 5})
    assert LiveRun.objects.get(pk=run.pk).spool_rows == 5
    assert not SpoolRecord.objects.exists()  # no replay run 7 here, and a live run_id is none of its
    assert LiveRun.objects.get(pk=other.pk).spool_rows == 4  # another spool's book is untouched
    LiveRun.sync_spool("host-a:/spool", {})
    assert LiveRun.objects.get(pk=run.pk).spool_rows == 0
    LiveRun.record_quarantined("host-a:/spool", "/spool/quarantine/x.torn", {run.run_id: 2, 7: 1})
    assert LiveRun.objects.get(pk=run.pk).lost == 2


def test_the_admin_lists_live_runs_read_only(admin_client):
    run = LiveRun.register("host-a:/spool", "gw:1")
    page = admin_client.get("/admin/gateway/liverun/")
    assert page.status_code == 200 and str(run.run_id) in page.content.decode()
    assert admin_client.get("/admin/gateway/liverun/add/").status_code == 403


def test_the_spool_s_books_follow_a_flush_by_another_process(store, tmp_path, monkeypatch):
    from samples.spool import SpoolingWriter

    down = switch_off(store, monkeypatch)
    down.set()
    rec = recorder(store, tmp_path, retry_s=3600.0)  # its own retry stays out of the way
    rec.start()
    for i in range(30):
        record(rec, i)
    wait_until(lambda: LiveRun.for_run_id(rec.run_id).spool_rows == 30, "the books count the 30 spooled")
    down.clear()
    # `manage.py flush_samples` in another process: its hooks are the replay's, not the live runs'
    SpoolingWriter(store, str(tmp_path / "spool")).flush()
    wait_until(lambda: LiveRun.for_run_id(rec.run_id).spool_rows == 0, "the recorder's heartbeat saw it")
    assert rec.close() is True
    assert physical(store, rec.run_id) == (30, 30)


def test_a_long_spool_is_flushed_a_file_at_a_time_while_new_samples_keep_coming(store, tmp_path, monkeypatch):
    down = switch_off(store, monkeypatch)
    down.set()
    # flush_budget_s=0: every flush stops after one file, so draining takes many loops
    rec = recorder(store, tmp_path, batch_rows=5, flush_budget_s=0.0)
    rec.start()
    ids = []
    for i in range(12):
        ids.append(record(rec, i))
        wait_until(lambda n=i + 1: rec.counts()["spooled"] == n, "spooled one by one")  # a file each
    assert len(rec.writer.spool.pending_files()) == 12
    down.clear()
    ids += [record(rec, i) for i in range(12, 40)]  # while the spool drains
    wait_until(
        lambda: rec.writer.spool.pending_files() == [] and len(stored(store, rec.run_id)) == 40,
        "the spool drained and every sample stored",
    )
    assert rec.close() is True
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert physical(store, rec.run_id) == (40, 40)


@pytest.mark.services
@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_second_signal_during_the_drain_still_closes_the_recorder(
    signame, etcd_weights, settings, sample_store, document, users, tmp_path
):
    """A signal twice while a stream drains. SIGINT: uvicorn's force quit ("CTRL+C to force
    quit") cuts the stream and skips the lifespan shutdown, where the gateway closes its
    recorder: the exit hook closes it instead, so what it holds is written and its live run is
    closed, not left running for the next start to mark abandoned. SIGTERM: uvicorn (0.54) does
    not force on it; the stream ends whole and the lifespan shutdown closes the recorder."""
    sim = start_in_thread("default", model="tiny-llama")  # ~15 ms a token: a stream lasts seconds
    child = None
    try:
        for v in document["variants"]:
            v["endpoint"], v["api"] = sim.url + "/v1", "chat"
        experiment = services.apply_document(document, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        child, url = start_gateway_command(settings, tmp_path)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        stream = client.chat.completions.create(
            model="ttft-opt",
            messages=[{"role": "user", "content": "Tell me a long story"}],
            user="u-2",
            max_tokens=400,
            stream=True,
        )
        chunks = iter(stream)
        next(chunks)  # the stream is under way: the drain will wait for it
        reply = client.chat.completions.with_raw_response.create(
            model="ttft-opt", messages=[{"role": "user", "content": "Hi"}], user="u-1", max_tokens=2
        )
        done_id = reply.headers["x-request-id"]
        sig = getattr(signal, signame)
        child.send_signal(sig)
        time.sleep(0.3)  # uvicorn is draining: waiting for the stream
        child.send_signal(sig)
        got, cut = 0, False
        try:
            for chunk in chunks:
                got += bool(chunk.choices and chunk.choices[0].delta.content)
        except (openai.APIError, httpx.HTTPError):
            cut = True
        out = child.communicate(timeout=60)[0].decode()
        if signame == "SIGINT":
            assert cut and got < 400, "the stream ended whole: the second SIGINT came after the drain"
        else:
            assert not cut and got == 400, (cut, got)  # every token (the first event read above is the role)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        sim.stop()
    [run] = LiveRun.objects.all()
    assert run.status == LiveRun.Status.CLOSED, out[-3000:]
    assert run.recorded == run.stored + run.spooled >= 1 and run.dropped == 0
    stored_ids = {
        rid for (rid,) in sample_store.query(f"SELECT request_id FROM {SAMPLES_FROM} WHERE mode = 'live'")
    }
    assert done_id in stored_ids
    # who closed it: the exit hook only when uvicorn skipped the lifespan shutdown
    assert ("closing the recorder" in out) is (signame == "SIGINT"), out[-3000:]


def test_the_sample_is_handed_over_before_the_response_s_end_goes_out(running, make_gateway):
    """The gateway's ASGI messages and its recorder's calls, in one order: the sample is in the
    queue file before the client can see its response end (gateway/attempts.py), so a process
    killed after that end loses no sample of a completed request."""
    import asyncio
    import json

    served = make_gateway()
    order: list[str] = []

    class Ordered(FakeRecorder):
        def record(self, result, **fields) -> None:
            order.append("record")
            super().record(result, **fields)

    served.gateway.attempts.recorder = Ordered()
    body = json.dumps(
        {"model": running.key, "messages": [{"role": "user", "content": "hi"}], "user": "u-1", "stream": True}
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }

    async def exchange() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        forever = asyncio.get_running_loop().create_future()

        async def receive():
            return messages.pop() if messages else await forever

        async def send(message):
            if message["type"] == "http.response.body":
                order.append("body" if message.get("more_body") else "end")

        await served.gateway(scope, receive, send)

    asyncio.run(exchange())
    assert order.count("record") == 1 and order[-1] == "end" and "body" in order
    assert order.index("record") < order.index("end"), order
