"""A real Celery worker on Redis killed with SIGKILL mid-shard: the shard is redelivered to a
new worker, resumes without re-sending what was recorded, and the run ends with exactly one
sample per request (ClickHouse server, file SQLite shared by the processes)."""

import datetime as dt
import os
import signal
import time

import pytest
from django.utils import timezone

from samples.backends.clickhouse import ClickHouseServerBackend
from simulator.serve import start_in_thread
from tests.workers.background import manage, start_demo_experiment, start_worker, stop_all
from workers import tasks


def store_count(env) -> int:
    store = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"])
    try:
        return int(store.query("SELECT count() FROM samples")[0][0])
    except Exception:
        return 0


def run_status(env) -> str:
    out = manage(
        env, "shell", "-c", "from workers.models import ReplayRun; print(ReplayRun.objects.get().status)"
    )
    return out.strip().splitlines()[-1]


def test_killed_worker_shard_resumes_with_exactly_one_sample_per_request(broker_env, tmp_path):
    env = broker_env
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    workers = []
    try:
        start_demo_experiment(env, tmp_path, sims)
        log = tmp_path / "worker.log"
        workers.append(start_worker(env, log))
        manage(env, "replay", "ttft-optimizations", "--trace", "data/traces/azure_llm_2023_code.csv",
               "--limit", "600", "--speed", "20", "--shards", "2")  # about 12 s of schedule  # fmt: skip
        deadline = time.monotonic() + 60
        while store_count(env) < 60:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(workers[0].pid, signal.SIGKILL)  # the whole worker: parent and children
        workers[0].wait()
        killed_at = store_count(env)
        assert killed_at < 600, "the kill came too late to test anything"
        workers.append(start_worker(env, log))
        deadline = time.monotonic() + 150
        while run_status(env) not in ("done", "failed", "cancelled"):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert run_status(env) == "done", log.read_text()[-3000:]
        store = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"])
        per_seq = dict(store.query("SELECT seq, count() FROM samples GROUP BY seq"))
        assert sorted(per_seq) == list(range(600)) and set(per_seq.values()) == {1}
        attempts = dict(store.query("SELECT attempt, count() FROM samples GROUP BY attempt"))
        assert attempts.get(2, 0) > 0, attempts  # the resumed deliveries recorded the rest
    finally:
        stop_all(workers, sims)


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
