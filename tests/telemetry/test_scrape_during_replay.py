"""Scraping /metrics during a replay sees the progress, lag and spool series move.

Production shape on one machine: a real Celery worker (prefork, 2 children) on Redis, the web
under gunicorn with 2 workers, both with ABPLAT_METRICS_DIR set; /metrics of the web sums every
process's files. Mid-replay the sample store goes away (a proxy in front of the real ClickHouse
server is switched off): samples go to the spool, and the spool's series rise; it comes back,
the spool drains, and the run ends done with every series accounted for.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.parse
import urllib.request

from simulator.serve import start_in_thread
from tests.plugin import FlakyProxy
from tests.telemetry.conftest import free_port, scrape, total, wait_until
from tests.workers.background import ROOT, TRACE, manage, start_demo_experiment, start_worker, stop_all

REQUESTS = 900  # about 18 s of the trace's schedule at 20x


def start_web(env: dict, tmp_path, port: int) -> subprocess.Popen:
    """The production web server as shipped: gunicorn with the project's gunicorn.conf.py (its
    child_exit hook marks exited workers dead in the metrics directory), 2 workers."""
    log = (tmp_path / "web.log").open("ab")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            str(ROOT / "gunicorn.conf.py"),
            "-b",
            f"127.0.0.1:{port}",
            "abplat.wsgi",
        ],
        cwd=ROOT,
        env={**env, "ABPLAT_WEB_WORKERS": "2"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_metrics_move_during_a_replay_and_the_spool_rises_and_drains(broker_env, tmp_path):
    env = dict(broker_env)
    clickhouse = urllib.parse.urlsplit(env["ABPLAT_CLICKHOUSE_URL"])
    proxy = FlakyProxy((clickhouse.hostname, clickhouse.port))
    proxy.up()
    env["ABPLAT_CLICKHOUSE_URL"] = clickhouse._replace(netloc=f"default:@127.0.0.1:{proxy.port}").geturl()
    env["ABPLAT_METRICS_DIR"] = str(tmp_path / "metrics")  # created by the first process
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / "worker.log", tmp_path / "web.log"]
    try:
        start_demo_experiment(env, tmp_path, sims)
        procs.append(start_worker(env, logs[0]))
        procs.append(start_web(env, tmp_path, port))
        wait_until(lambda: urllib.request.urlopen(url, timeout=2).status == 200, 60, "the web", logs)
        before = scrape(url)
        assert total(before, "abplat_replay_requests_sent_total") == 0

        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            TRACE,
            "--limit",
            str(REQUESTS),
            "--speed",
            "20",
            "--shards",
            "2",
        )
        # 1. Progress: requests sent and completed, and their schedule lag, counted as they go.
        wait_until(
            lambda: total(scrape(url), "abplat_replay_requests_completed_total") >= 50,
            90,
            "the first samples",
            logs,
        )
        first = scrape(url)
        assert total(first, "abplat_replay_shards_running") >= 1
        assert total(first, "abplat_replay_runs", status="running") == 1
        # 2. The store goes away: the spool fills (rows, bytes, samples spooled) while requests go on.
        proxy.down()
        moving = (
            "abplat_replay_requests_sent_total",
            "abplat_replay_requests_completed_total",
            "abplat_replay_schedule_lag_seconds_count",
            "abplat_replay_schedule_lag_seconds_sum",
        )
        seen = {}

        def spooling_and_sending() -> bool:
            # one scrape judged whole: every progress counter moved past the first scrape's, and
            # the spool holds rows (a request sent may not be completed yet: wait for both)
            seen["now"] = now = scrape(url)
            return total(now, "abplat_spool_rows") >= 20 and all(
                total(now, name) > total(first, name) for name in moving
            )

        wait_until(spooling_and_sending, 60, "samples in the spool while requests go on", logs)
        second = seen["now"]
        assert total(second, "abplat_spool_bytes") > 0
        assert total(second, "abplat_spool_spooled_rows_total") >= total(second, "abplat_spool_rows") >= 20
        assert total(second, "abplat_replay_samples_written_total", destination="spool") > 0
        assert total(second, "abplat_replay_requests_completed_total") < REQUESTS, "the replay ended too soon"
        # 3. Back: the spool drains into the store and the run ends done.
        proxy.up()
        wait_until(lambda: total(scrape(url), "abplat_replay_runs", status="done") == 1, 150, "the run", logs)
        end = scrape(url)
    finally:
        proxy.down()
        stop_all(procs, sims)  # the worker and gunicorn: SIGTERM to each process group
    assert total(end, "abplat_replay_requests_sent_total") == REQUESTS
    assert total(end, "abplat_replay_requests_completed_total", outcome="ok") == REQUESTS
    assert (
        total(end, "abplat_replay_requests_in_flight") == 0
        and total(end, "abplat_replay_shards_running") == 0
    )
    assert total(end, "abplat_replay_schedule_lag_seconds_count") == REQUESTS
    assert total(end, "abplat_spool_rows") == 0 and total(end, "abplat_spool_bytes") == 0
    spooled = total(end, "abplat_spool_spooled_rows_total")
    # A flush skips rows already stored (an insert that landed as the store went away).
    flushed = total(end, "abplat_spool_flushed_rows_total")
    assert 0 < flushed <= spooled
    assert total(end, "abplat_spool_flushes_total", result="ok") >= 1
    written = total(end, "abplat_replay_samples_written_total")
    assert (
        written == REQUESTS
        and total(end, "abplat_replay_samples_written_total", destination="spool") == spooled
    )
    # Every sample reached the store once: straight from the replay, or flushed from the spool.
    assert total(end, "abplat_store_inserted_rows_total", backend="clickhouse-server") == REQUESTS - (
        spooled - flushed
    )
    assert total(end, "abplat_replay_shards_finished_total", status="done") >= 2
    assert total(end, "abplat_router_snapshot_revision", store="local") >= 1
    # The scrapes themselves, counted by whichever gunicorn worker answered and summed.
    assert total(end, "abplat_http_requests_total", view="metrics", status="2xx") >= 5
