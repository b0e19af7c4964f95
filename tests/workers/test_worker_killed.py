"""A real Celery worker on Redis killed with SIGKILL mid-shard: the shard is redelivered to a
new worker, resumes without re-sending what was recorded, and the run ends with exactly one
sample per request (ClickHouse server, file SQLite shared by the processes)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from samples.backends.clickhouse import ClickHouseServerBackend
from simulator.serve import start_in_thread
from tests.plugin import server_url_for
from tests.workers.background import ROOT, manage, start_demo_experiment

REDIS_URL = os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def env(tmp_path, clickhouse_server):
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"Redis not reachable at {REDIS_URL} ({exc}); start it (scripts/services.sh start)")
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    yield {
        **base, "ABPLAT_VAR": str(tmp_path), "ABPLAT_BROKER_URL": REDIS_URL,
        "ABPLAT_CLICKHOUSE_URL": server_url_for(database, clickhouse_server),
        "ABPLAT_VISIBILITY_TIMEOUT": "5", "ABPLAT_LOG_LEVEL": "INFO",
    }  # fmt: skip
    ClickHouseServerBackend(server_url_for(database, clickhouse_server)).execute(
        f"DROP DATABASE IF EXISTS {database}"
    )


def start_worker(env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "abplat", "worker", "--pool", "prefork", "-c", "2",
         "--without-gossip", "--without-mingle", "-n", f"w{time.monotonic_ns()}@%h"],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


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


def test_killed_worker_shard_resumes_with_exactly_one_sample_per_request(env, tmp_path):
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
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGTERM)
                w.wait(30)
        for s in sims:
            s.stop()
