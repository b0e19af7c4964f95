"""The variants' own /metrics during a replay: scraped into the sample store beside the samples
(eager Celery on chDB and the ClickHouse server; windowed shard tasks on real workers), failures
recorded and never fatal, and shown by the report next to client TTFT."""

from __future__ import annotations

import asyncio
import http.server
import io
import threading
import time

import pytest
from django.core.management import call_command

from analysis import server_metrics as sm
from analysis.definitions import PHASES, Filters
from dashboards import reports as report
from samples.backends.clickhouse import ClickHouseServerBackend
from streaming import scrape
from streaming.egress import parse_allowlist
from tests.workers.background import manage, start_worker, stop_all
from workers.models import ReplayRun

TRACE = "data/traces/azure_llm_2023_code.csv"
QUEUE_COUNT = "vllm:request_queue_time_seconds_count"


def replay(*args) -> str:
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, *args, stdout=out)
    return out.getvalue()


def queue_increase(store, run_id: int) -> dict[str, float]:
    got = sm.read(store, Filters("ttft-opt", run_id=run_id), [], bucket_s=10)
    return {v: agg["hist"].get("queue", {}).get("count", 0.0) for v, agg in got.items()}


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_replay_stores_each_variants_metrics_and_the_report_splits_misses(running, sample_store, settings):
    settings.SERVER_METRICS_INTERVAL_S = 1
    running.__class__.objects.filter(pk=running.pk).update(sla_ttft_ms=0.5)  # nearly every request misses
    running.refresh_from_db()
    replay("--limit", "90", "--speed", "100")  # ~1.9 s of schedule
    run = ReplayRun.objects.get()
    assert run.status == "done", run.error
    served = sample_store.counts_by_variant(run.pk)
    # every request a variant served is in its queue histogram's increase over the run: the
    # baseline came before the first send, the last scrape after the last answer
    assert queue_increase(sample_store, run.pk) == pytest.approx({v: float(n) for v, n in served.items()})
    scrapes = sample_store.query(
        "SELECT variant, count(), min(value) FROM (SELECT variant, scraped_ms, any(value) AS value "
        "FROM server_metrics WHERE run_id = %(r)s AND sample = 'abplat:scrape_up' GROUP BY variant, scraped_ms) "
        "GROUP BY variant ORDER BY variant",
        {"r": run.pk},
    )
    # a baseline, about one a second over the ~2 s schedule, and the final one; none failed
    assert [(v, n >= 3, up) for v, n, up in scrapes] == [(v, True, 1.0) for v in sorted(served)]

    rep = report.build_report(sample_store, report.experiment_info(running), Filters("ttft-opt"))
    assert rep["server"]["available"] is True
    for entry in rep["variants"]:
        v, server = entry["key"], rep["server"]["variants"][entry["key"]]
        assert (
            server["requests_finished"] == served[v] == server["queue_ms"]["n"] == server["prefill_ms"]["n"]
        )
        assert server["scrapes"]["failed"] == 0 and server["scrapes"]["ok"] >= 3
        # the server's queue + prefill means fit inside its TTFT mean, and the client's TTFT
        # percentiles sit beside them
        assert server["queue_ms"]["mean_ms"] + server["prefill_ms"]["mean_ms"] <= server["ttft_ms"]["mean_ms"]
        assert server["client_ttft_ms"]["p50"] == entry["percentiles"]["ttft_ms"][0]["value"]
        split = rep["phases"][v]["server_split"]
        assert split["basis"] == "interval_aggregates" and split["available"] is True
        assert split["covered_misses"] == split["misses"] == entry["n"] - entry["hits"] > 0
        # the split re-divides the client's phases of the misses: the same total
        client_total = sum(rep["phases"][v]["phases"][p]["mean_ms"] for p in PHASES)
        assert sum(p["mean_ms"] for p in split["phases"].values()) == pytest.approx(client_total)
        assert split["phases"]["server_prefill"]["mean_ms"] > 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_variant_whose_metrics_fail_is_recorded_and_the_replay_still_completes(
    running, sample_store, settings, monkeypatch
):
    settings.SERVER_METRICS_INTERVAL_S = 1
    broken = running.variants.get(key="awq").endpoint.rstrip("/")[: -len("/v1")] + "/metrics"
    real = scrape.MetricsFetcher.fetch

    async def fetch(self):
        if self.url == broken:
            raise scrape.ScrapeError(f"GET {self.url}: HTTP 503")
        return await real(self)

    monkeypatch.setattr(scrape.MetricsFetcher, "fetch", fetch)
    replay("--limit", "30", "--speed", "40")
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.samples_recorded == 30, run.error
    rep = report.build_report(sample_store, report.experiment_info(running), Filters("ttft-opt"))
    bad, good = rep["server"]["variants"]["awq"], rep["server"]["variants"]["fp16"]
    assert bad["scrapes"]["ok"] == 0 and bad["scrapes"]["failed"] >= 2
    assert bad["scrapes"]["last_error"] == f"GET {broken}: HTTP 503"
    assert bad["requests_finished"] == 0 and bad["queue_ms"]["mean_ms"] is None
    assert good["scrapes"]["failed"] == 0 and good["requests_finished"] > 0
    assert rep["phases"]["awq"]["server_split"]["available"] is False


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_scraping_off_stores_nothing(running, sample_store, settings):
    settings.SERVER_METRICS_INTERVAL_S = 0
    replay("--limit", "10", "--speed", "40")
    assert ReplayRun.objects.get().status == "done"
    assert sample_store.query("SELECT count() FROM server_metrics") == [(0,)]


# ---- the fetch itself: bounded, under the egress rules, with the variant's credentials -------


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"
    seen: list[dict] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
        if self.mode == "slow":
            time.sleep(1.5)
        body = {"ok": b"# TYPE x gauge\nx 1.0\n", "big": b"x 1.0\n" * 50_000, "slow": b"x 1\n", "404": b"no"}[
            self.mode
        ]
        self.send_response(404 if self.mode == "404" else 200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def metrics_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.seen = []
    yield server
    server.shutdown()
    server.server_close()


def fetch(url: str, mode: str, **kw) -> str:
    _Handler.mode = mode

    async def go():
        f = scrape.MetricsFetcher(url, **kw)
        try:
            return await f.fetch()
        finally:
            await f.aclose()

    return asyncio.run(go())


def test_the_fetch_is_bounded_checked_and_carries_the_variants_secret(metrics_server):
    url = f"http://127.0.0.1:{metrics_server.server_address[1]}/v1"
    allow = parse_allowlist(["127.0.0.0/8"])
    assert (
        fetch(url, "ok", allow=allow, headers={"Authorization": "Bearer s3cret"}) == "# TYPE x gauge\nx 1.0\n"
    )
    assert _Handler.seen[-1]["path"] == "/metrics" and _Handler.seen[-1]["authorization"] == "Bearer s3cret"
    with pytest.raises(scrape.ScrapeError, match="larger than 100000 bytes"):
        fetch(url, "big", allow=allow, max_bytes=100_000)
    with pytest.raises(scrape.ScrapeError, match="within 0.5 s"):
        fetch(url, "slow", allow=allow, timeout_s=0.5)
    with pytest.raises(scrape.ScrapeError, match="HTTP 404"):
        fetch(url, "404", allow=allow)
    n = len(_Handler.seen)
    with pytest.raises(scrape.ScrapeError, match="outside the variant allowlist") as info:
        fetch(url, "ok", allow=parse_allowlist(["10.0.0.0/8"]), headers={"Authorization": "Bearer s3cret"})
    assert len(_Handler.seen) == n and "s3cret" not in str(info.value)  # nothing sent, no secret shown
    with pytest.raises(ValueError, match="credentials"):
        scrape.metrics_url("http://user:key@127.0.0.1:1/v1")


# ---- windowed shard tasks on real workers: one scraper per window, no gap, nothing twice ------


@pytest.mark.services
def test_windowed_shards_scrape_one_at_a_time_and_count_every_request_once(demo_env, tmp_path):
    env = {
        **demo_env,
        "ABPLAT_TASK_SOFT_TIME_LIMIT_S": "8",
        "ABPLAT_REPLAY_WINDOW_S": "3",
        "ABPLAT_VISIBILITY_TIMEOUT": "60",
        "ABPLAT_SERVER_METRICS_INTERVAL_S": "1",
    }
    log = tmp_path / "worker.log"
    workers = []
    try:
        workers = [start_worker(env, log), start_worker(env, log)]
        # 240 requests at 20/s: 12 s of schedule, four 3 s windows of two slots each
        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            TRACE,
            "--limit",
            "240",
            "--arrival",
            "poisson",
            "--rate",
            "20",
            "--shards",
            "2",
            "--wait",
        )
        store = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"])
        ((run_id, status),) = store.query("SELECT run_id, argMax(status, version) FROM runs GROUP BY run_id")
        assert status == "done", log.read_text()[-3000:]
        served = store.counts_by_variant(run_id)
        assert sum(served.values()) == 240
        got = sm.read(store, Filters("ttft-optimizations", run_id=run_id), [], bucket_s=10)
        assert {v: a["hist"]["queue"]["count"] for v, a in got.items()} == pytest.approx(
            {v: float(n) for v, n in served.items()}
        )
        # one scraper at a time per variant: no two scrapes of a variant overlap in time
        for variant in served:
            spans = sorted(
                (t - d * 1000, t)
                for t, d in store.query(
                    "SELECT scraped_ms, any(value) FROM server_metrics WHERE run_id = %(r)s AND variant = %(v)s "
                    "AND sample = 'abplat:scrape_duration_seconds' GROUP BY scraped_ms",
                    {"r": run_id, "v": variant},
                )
            )
            assert len(spans) >= 10, (variant, spans)
            assert all(a_end <= b_start for (_a, a_end), (b_start, _b) in zip(spans, spans[1:])), spans
    finally:
        stop_all(workers)
