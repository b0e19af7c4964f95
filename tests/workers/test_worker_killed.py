"""A real Celery worker on Redis killed with SIGKILL mid-shard: the shard is redelivered to a
new worker, resumes without re-sending what was recorded, and the run ends with exactly one
sample per request (ClickHouse server, file SQLite shared by the processes). The lease
(settings.REPLAY_LEASE_S, 10 s) really expires here: a message redelivered before it did finds
the dead worker's heartbeat still fresh and looks again once that heartbeat is a lease old."""

import datetime as dt
import os
import signal

import pytest
from django.utils import timezone

from samples.backends.clickhouse import ClickHouseServerBackend
from tests.workers.background import manage, start_worker, stop_all, store_count, wait_final, wait_for
from workers import tasks


def test_killed_worker_shard_resumes_with_exactly_one_sample_per_request(demo_env, tmp_path):
    env = demo_env
    log = tmp_path / "worker.log"
    workers = [start_worker(env, log)]  # it starts while the replay below is planned and queued
    try:
        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "300",
            "--speed",
            "20",
            "--shards",
            "2",
        )  # about 6 s of schedule
        wait_for(lambda: store_count(env) >= 60, 90, poll=0.1, message=lambda: log.read_text()[-3000:])
        os.killpg(workers[0].pid, signal.SIGKILL)  # the whole worker: parent and children
        workers[0].wait()
        killed_at = store_count(env)
        assert killed_at < 300, "the kill came too late to test anything"
        workers.append(start_worker(env, log))
        assert wait_final(env, log, 150) == "done", log.read_text()[-3000:]
        store = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"])
        per_seq = dict(store.query("SELECT seq, count() FROM samples GROUP BY seq"))
        assert sorted(per_seq) == list(range(300)) and set(per_seq.values()) == {1}
        attempts = dict(store.query("SELECT attempt, count() FROM samples GROUP BY attempt"))
        assert attempts.get(2, 0) > 0, attempts  # the resumed deliveries recorded the rest
    finally:
        stop_all(workers)


def test_a_redelivered_message_looks_again_when_the_lease_it_found_expires(settings):
    now = timezone.now()
    settings.REPLAY_LEASE_S = 10

    def ago(seconds: float) -> dt.datetime:
        return now - dt.timedelta(seconds=seconds)

    assert tasks.lease_countdown(ago(8), now) == pytest.approx(2.5)  # half a second past it
    assert tasks.lease_countdown(ago(9.9), now) == 1.0  # at least a second
    assert tasks.lease_countdown(now, now) == tasks.lease_countdown(None, now) == 10.0  # a lease at most
    settings.REPLAY_LEASE_S = 3
    assert tasks.lease_countdown(ago(1), now) == pytest.approx(2.5)
